"""Typed configuration: YAML preset -> dataclasses -> `--a.b=value` overrides -> the code.

Every key is checked: an unknown or mistyped key, or a value of the wrong type or outside its
allowed range, is a `ConfigError` that names the key and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


@dataclass
class ModelConfig:
    arch: Literal["gpt2", "transformer_lm"] = "gpt2"
    vocab_size: int = 50257
    context_length: int = 1024
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int | None = None  # None: 4 * d_model
    dropout: float = 0.0
    bias: bool = True  # biases of the linear layers and LayerNorms (gpt2 only)
    qkv_bias: bool = True  # bias of the fused q/k/v projection (gpt2 only)
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    init_std: float = 0.02  # gpt2 weight init; ~1/sqrt(d_model) suits small models better
    rope_theta: float = 10000.0  # transformer_lm only
    norm_eps: float = 1e-5
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # matmul dtype; params stay f32
    kernels: Literal["xla", "pallas"] = "xla"  # softmax + LayerNorm through pallas_kernels
    attention_impl: Literal["xla", "dot_product_attention"] = "xla"
    # Training loss: "xla" = logits, then softmax_loss; "pallas" = the fused LM head +
    # cross-entropy kernel (pallas_kernels.linear_cross_entropy), which never keeps the logits.
    loss_impl: Literal["xla", "pallas"] = "xla"

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def validate(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            _positive(f"model.{name}", getattr(self, name))
        if self.d_ff is not None:
            _positive("model.d_ff", self.d_ff)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads "
                f"({self.n_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        _positive("model.init_std", self.init_std)
        if self.norm_eps <= 0:
            raise ConfigError(f"model.norm_eps must be > 0, got {self.norm_eps}")
        if self.arch == "transformer_lm":
            if self.bias or self.qkv_bias:
                raise ConfigError(
                    "arch transformer_lm has no biases: set model.bias=false and "
                    "model.qkv_bias=false"
                )
            if (self.d_model // self.n_heads) % 2:
                raise ConfigError(
                    "transformer_lm needs an even head dim (d_model / n_heads) for RoPE"
                )
            if self.rope_theta <= 0:
                raise ConfigError(f"model.rope_theta must be > 0, got {self.rope_theta}")


@dataclass
class AssociativeRecallConfig:
    vocab_size: int = 32  # keys are the first half of the ids, values the second half
    num_pairs: int = 8
    num_train: int = 10_000
    num_test: int = 1_000
    seed: int = 0

    def validate(self) -> None:
        if self.vocab_size < 4 or self.vocab_size % 2:
            raise ConfigError(
                f"data.associative_recall.vocab_size must be even and >= 4, got {self.vocab_size}"
            )
        if not 1 <= self.num_pairs <= self.vocab_size // 2:
            raise ConfigError(
                f"data.associative_recall.num_pairs must be in [1, vocab_size/2 = "
                f"{self.vocab_size // 2}] (keys are distinct), got {self.num_pairs}"
            )
        _positive("data.associative_recall.num_train", self.num_train)
        _positive("data.associative_recall.num_test", self.num_test)


@dataclass
class TokensConfig:
    """Flat token files written by `python -m jaxllm.data.prepare`. Relative paths resolve
    against $JAXLLM_DATA_DIR when it is set."""

    train_path: str = "train.bin"
    val_path: str = "val.bin"
    bpe_dir: str | None = None  # GPT-2 BPE files; None: $JAXLLM_BPE_DIR, then tiktoken's cache


@dataclass
class DataConfig:
    kind: Literal["associative_recall", "tokens"] = "associative_recall"
    associative_recall: AssociativeRecallConfig = field(default_factory=AssociativeRecallConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate, reached at the end of warm-up
    min_lr: float = 3e-5  # reached exactly at the last step
    warmup_steps: int = 100
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_and_embeddings: bool = False  # weight decay on norm scales, biases, embeddings
    grad_clip: float = 1.0  # global-norm clipping; 0 disables

    def validate(self) -> None:
        _positive("optim.lr", self.lr)
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        _positive("optim.eps", self.eps)
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("optim.weight_decay and optim.grad_clip must be >= 0")


@dataclass
class TrainConfig:
    seed: int = 0
    batch_size: int = 64
    steps: int = 1000
    eval_every: int = 200  # steps between evaluations (and at the end)
    eval_batches: int = 16  # held-out batches per evaluation (token data)
    log_every: int = 10
    run_dir: str = "runs/default"
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 3  # the last K; the best by eval loss is kept apart
    resume: bool = True  # continue from run_dir's latest checkpoint if there is one
    progress: bool = True  # tqdm bar

    def validate(self) -> None:
        for name in (
            "batch_size",
            "steps",
            "eval_every",
            "eval_batches",
            "log_every",
            "keep_checkpoints",
        ):
            _positive(f"train.{name}", getattr(self, name))
        if self.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every must be >= 0, got {self.checkpoint_every}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> Config:
        self.model.validate()
        self.data.associative_recall.validate()
        self.optim.validate()
        self.train.validate()
        if self.optim.warmup_steps >= self.train.steps:
            raise ConfigError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) must be < train.steps "
                f"({self.train.steps})"
            )
        if self.data.kind == "associative_recall":
            ar = self.data.associative_recall
            if self.model.vocab_size < ar.vocab_size:
                raise ConfigError(
                    f"model.vocab_size ({self.model.vocab_size}) must be >= "
                    f"data.associative_recall.vocab_size ({ar.vocab_size})"
                )
            if self.model.context_length < 2 * ar.num_pairs + 1:
                raise ConfigError(
                    f"model.context_length ({self.model.context_length}) must be >= "
                    f"2 * num_pairs + 1 = {2 * ar.num_pairs + 1}"
                )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


# ----------------------------------------------------------------------------- parsing


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, checking every key and value type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = path or "top level"
        raise ConfigError(f"unknown key(s) {unknown} at {where}; valid keys: {names}")
    kwargs = {k: _coerce(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")  # schema bug, not user error


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['--model.n_layers=2', '--train.steps', '100'] -> {'model.n_layers': 2, 'train.steps': 100}.

    Values are parsed as YAML scalars, so `1e-3`, `true`, `null` and `bfloat16` all work.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an override like --train.steps=100, got {arg!r}")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            i += 1
            raw = args[i]
        value = yaml.safe_load(raw) if raw != "" else ""
        if isinstance(value, str) and raw.strip().lower() in ("nan", ".nan"):
            value = float("nan")
        out[key] = value
        i += 1
    return out


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set tree['a']['b'] = value for 'a.b', checking each key against the schema."""
    keys = dotted.split(".")
    cls: Any = Config
    node = tree
    for depth, key in enumerate(keys):
        names = [f.name for f in dataclasses.fields(cls)]
        if key not in names:
            where = ".".join(keys[:depth]) or "top level"
            raise ConfigError(f"unknown key {dotted!r}: {key!r} is not in {where}; valid: {names}")
        if depth == len(keys) - 1:
            node[key] = value
            return
        cls = typing.get_type_hints(cls)[key]
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{'.'.join(keys[: depth + 1])} is a value, not a section")
        node = node.setdefault(key, {})


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML preset (or the defaults), apply CLI overrides, validate, return a Config."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a YAML mapping at the top level")
        tree = loaded or {}
    for dotted, value in parse_overrides(overrides or []).items():
        _set_path(tree, dotted, value)
    return from_dict(Config, tree).validate()


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML (temp name, then rename), loadable by `load_config`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)
