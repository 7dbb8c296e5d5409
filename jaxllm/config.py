"""Typed configuration: YAML preset -> frozen dataclasses -> `--a.b=value` overrides -> the code.

Every section is a frozen dataclass validated once, when it is built: each field declares its
type and range next to it (`spec(default, gt=0)`), one generic loop checks them, and the few
rules that tie fields together live in the section's `_check` (or, across sections, in
`Config._check`). Unknown or mistyped keys, wrong types, NaN/inf and out-of-range values are a
`ConfigError` that names the key and what is allowed. Frozen configs are hashable, so a model
or a jitted function can take one as a static argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from jaxllm.atomic_file import write_text_atomic


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def spec(
    default: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    nonempty: bool = False,
) -> Any:
    """A dataclass field with a default and its allowed range (checked by `Section`)."""
    return field(
        default=default, metadata={"gt": gt, "ge": ge, "lt": lt, "le": le, "nonempty": nonempty}
    )


class Section:
    """Base of the config dataclasses: coerce and range-check every field on construction."""

    PATH: ClassVar[str] = ""  # dotted prefix for messages, e.g. "model"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            path = f"{self.PATH}.{f.name}" if self.PATH else f.name
            value = _coerce(hints[f.name], getattr(self, f.name), path)
            _check_range(path, value, f.metadata)
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Rules between fields of this section."""


_BOUNDS = (("gt", ">", float.__gt__), ("ge", ">=", float.__ge__),
           ("lt", "<", float.__lt__), ("le", "<=", float.__le__))  # fmt: skip


def _check_range(path: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite number, got {value}")
    if isinstance(value, str) and meta.get("nonempty") and not value.strip():
        raise ConfigError(f"{path} must be a non-empty string")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    bounds = [(sym, meta[key], op) for key, sym, op in _BOUNDS if meta.get(key) is not None]
    if all(op(float(value), float(b)) for _, b, op in bounds):
        return
    if len(bounds) == 2:  # lower and upper: interval notation
        (lo_sym, lo, _), (hi_sym, hi, _) = bounds
        allowed = f"in {'(' if lo_sym == '>' else '['}{lo:g}, {hi:g}{')' if hi_sym == '<' else ']'}"
    else:
        allowed = " and ".join(f"{sym} {b:g}" for sym, b, _ in bounds)
    raise ConfigError(f"{path} must be {allowed}, got {value}")


# execution.loss_chunk_mib's default: pallas_kernels.cross_entropy.LOGITS_CHUNK_BYTES in MiB (a test
# keeps the two equal; this module imports no kernels)
LOSS_CHUNK_MIB = 8192


@dataclass(frozen=True)
class ModelConfig(Section):
    """What the model is: its architecture and sizes, recorded in every checkpoint (a resume or a
    load takes it from there). How a run computes it is `ExecutionConfig`."""

    PATH: ClassVar[str] = "model"

    arch: Literal["gpt2", "transformer_lm"] = "gpt2"  # a file in jaxllm/models/
    vocab_size: int = spec(50257, gt=0)
    context_length: int = spec(1024, gt=0)
    d_model: int = spec(768, gt=0)
    n_layers: int = spec(12, gt=0)
    n_heads: int = spec(12, gt=0)
    d_ff: int | None = spec(None, gt=0)  # None: 4 * d_model
    bias: bool = True  # biases of the linear layers and LayerNorms (gpt2 only)
    qkv_bias: bool = True  # bias of the fused q/k/v projection (gpt2 only)
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    # gpt2's init: N(0, init_std^2), the residual projections scaled by 1/sqrt(2 n_layers);
    # ~1/sqrt(d_model) suits small models better. transformer_lm uses CS336's init instead.
    init_std: float = spec(0.02, gt=0.0)
    rope_theta: float = spec(10000.0, gt=0.0)  # transformer_lm only
    norm_eps: float = spec(1e-5, gt=0.0)
    # A causal depthwise conv1d over the normed input of every attention (H3 / Based "shift"):
    # each position sees its short_conv_size - 1 predecessors before attention does.
    short_conv: bool = False
    short_conv_size: int = spec(3, ge=2, le=7)  # the Pallas conv kernel takes K <= 7

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def _check(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads "
                f"({self.n_heads})"
            )
        if self.arch == "transformer_lm":
            if self.bias or self.qkv_bias:
                raise ConfigError(
                    "arch transformer_lm has no biases: set model.bias=false and "
                    "model.qkv_bias=false"
                )
            if self.head_dim % 2:
                raise ConfigError(
                    "transformer_lm needs an even head dim (d_model / n_heads) for RoPE"
                )


@dataclass(frozen=True)
class ExecutionConfig(Section):
    """How this run computes the model: dtypes, which implementation runs each op, memory
    trade-offs, training-only regularisation. Taken from the command line (or the run's
    config.yaml) on every start, resume and load; the parameters do not depend on it, except
    that scan_layers stacks the blocks' parameters (`jaxllm.models.stack_blocks`)."""

    PATH: ClassVar[str] = "execution"

    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # matmul dtype; params stay f32
    # The residual stream x (B, T, D) between blocks, and so its gradient: "float32" as under
    # torch autocast (every residual add and norm input exact to float32), or "bfloat16" (needs
    # compute_dtype bfloat16) as MaxText keeps activations: each add + norm moves a third less,
    # each residual add rounds to 8 bits of mantissa. Norm statistics stay float32 either way.
    residual_dtype: Literal["float32", "bfloat16"] = "float32"
    # Which implementation runs is decided in jaxllm/ops.py (`plan_ops`), which says it out loud:
    kernels: Literal["xla", "pallas"] = "xla"  # norms + attention softmax via pallas_kernels
    # "dot_product_attention": cuDNN flash attention on a GPU; "pallas": our flash attention
    # (pallas_kernels.flash_attention, Mosaic GPU, Hopper-class GPUs); "xla": the `kernels`
    # path; "auto": the fastest of those that can run (jaxllm.ops.plan_ops; with dropout > 0
    # the `kernels` path, the only one with attention dropout)
    attention_impl: Literal["auto", "xla", "dot_product_attention", "pallas"] = "auto"
    # Training loss: "xla" = logits, then softmax_loss; "pallas" = the fused LM head +
    # cross-entropy kernel (pallas_kernels.linear_cross_entropy), which never keeps the logits.
    loss_impl: Literal["xla", "pallas"] = "xla"
    # GPT-2's GELU MLP: "xla" = cuBLAS's GEMMs (the fc GEMM's epilogue writing h and gelu(h))
    # and a fusion applying GELU's backward after the dX GEMM; "pallas" = Mosaic GPU kernels
    # with GELU in both GEMMs' epilogues (pallas_kernels.matmul_gelu, matmul_dgelu; Hopper-class
    # GPUs, 16-bit matmuls; elsewhere XLA's, and the `ops:` line says so). Faster than "xla"
    # up to GPT-2 XL's widths, less so the wider; at the 2.7B size's about 0.95x backward and
    # a tie forward (estimated across calls, benchmarks/RESULTS.md).
    mlp_impl: Literal["xla", "pallas"] = "xla"
    # The Pallas kernels' lowering (norms, attention softmax, conv, fused loss): "auto" = Mosaic
    # GPU wherever its kernel can run (a Hopper-class GPU and the shapes it takes), Triton
    # elsewhere; "triton" = Triton everywhere; "mosaic_gpu" = Mosaic GPU for every Pallas kernel
    # (an error where it cannot run). Under either, where jax has the Triton lowering, a loss
    # without gradient and a softmax batch whose length is not a multiple of 128 run the Triton
    # kernel. The plan's `ops:` line names what runs.
    kernel_backend: Literal["auto", "triton", "mosaic_gpu"] = "auto"
    # The fused loss makes the logits for at most this many MiB of rows at a time (at least 32
    # rows), chunk after chunk, per device (the Mosaic kernel holds dz beside a chunk's logits:
    # twice this at the peak); 0: all rows at once. Same loss and gradients up to GEMM rounding.
    loss_chunk_mib: int = spec(LOSS_CHUNK_MIB, ge=0)
    # Activation rematerialisation: "block" wraps every decoder block in jax.checkpoint (saving
    # nothing inside it), so the backward pass recomputes each block's forward from its input:
    # activation memory drops from O(layers x block internals) to O(layers x D) per token, for
    # about one more forward pass of compute. Same loss and gradients.
    remat: Literal["none", "block"] = "none"
    # Run the blocks as one jax.lax.scan over their stacked parameters (params["blocks"], each
    # leaf with a leading n_layers axis) instead of n_layers unrolled copies: compile time no
    # longer grows with depth. The same function of the same parameters, stacked
    # (jaxllm.models.stack_blocks); named scopes read blocks/attn/... without a layer index.
    scan_layers: bool = False
    dropout: float = spec(0.0, ge=0.0, lt=1.0)  # training only
    # Training targets (1 - e) onehot + e / V; evaluation losses stay plain cross-entropy.
    label_smoothing: float = spec(0.0, ge=0.0, lt=1.0)

    # The fields that change what is trained (the objective), not how it is computed: a resume
    # that changes them is refused like a change of model (config_changes).
    OBJECTIVE: ClassVar[tuple[str, ...]] = ("dropout", "label_smoothing")

    def _check(self) -> None:
        if self.residual_dtype == "bfloat16" and self.compute_dtype != "bfloat16":
            raise ConfigError(
                "execution.residual_dtype=bfloat16 needs execution.compute_dtype=bfloat16 (got "
                f"{self.compute_dtype}): a float32 model keeps a float32 residual stream"
            )
        if self.kernel_backend != "auto" and "pallas" not in (self.kernels, self.loss_impl):
            raise ConfigError(
                f"execution.kernel_backend={self.kernel_backend} picks the Pallas kernels' "
                "lowering: it needs execution.kernels=pallas or execution.loss_impl=pallas"
            )
        if self.loss_chunk_mib != LOSS_CHUNK_MIB and self.loss_impl != "pallas":
            raise ConfigError(
                f"execution.loss_chunk_mib={self.loss_chunk_mib} sizes the fused loss kernel's "
                "chunks of rows: it needs execution.loss_impl=pallas"
            )
        if (
            self.kernel_backend == "mosaic_gpu"
            and self.loss_impl == "pallas"
            and self.compute_dtype != "bfloat16"
        ):
            raise ConfigError(
                "execution.kernel_backend=mosaic_gpu runs the fused loss in bfloat16: set "
                f"execution.compute_dtype=bfloat16 (got {self.compute_dtype}) or "
                "kernel_backend=triton"
            )
        if self.label_smoothing and self.loss_impl == "pallas":
            raise ConfigError(
                "execution.label_smoothing needs execution.loss_impl=xla: the fused Pallas loss "
                f"has no smoothing term (got label_smoothing={self.label_smoothing})"
            )
        if self.attention_impl not in ("auto", "xla") and self.dropout > 0:
            raise ConfigError(
                f"execution.attention_impl={self.attention_impl} has no attention dropout; set "
                f"execution.dropout=0 (got {self.dropout}) or execution.attention_impl=xla"
            )


@dataclass(frozen=True)
class AssociativeRecallConfig(Section):
    PATH: ClassVar[str] = "data.associative_recall"

    vocab_size: int = spec(32, ge=4)  # even: keys are the first half of the ids, values the rest
    num_pairs: int = spec(8, ge=1)
    num_train: int = spec(10_000, gt=0)
    num_test: int = spec(1_000, gt=0)
    seed: int = spec(0, ge=0)

    def _check(self) -> None:
        if self.vocab_size % 2:
            raise ConfigError(
                f"data.associative_recall.vocab_size must be even and >= 4, got {self.vocab_size}"
            )
        if self.num_pairs > self.vocab_size // 2:
            raise ConfigError(
                f"data.associative_recall.num_pairs must be in [1, vocab_size/2 = "
                f"{self.vocab_size // 2}] (keys are distinct), got {self.num_pairs}"
            )


@dataclass(frozen=True)
class TokensConfig(Section):
    """Flat token files written by `python -m jaxllm.data.prepare`. Relative paths resolve
    against $JAXLLM_DATA_DIR when it is set."""

    PATH: ClassVar[str] = "data.tokens"

    train_path: str = spec("train.bin", nonempty=True)
    val_path: str = spec("val.bin", nonempty=True)
    bpe_dir: str | None = None  # GPT-2 BPE files; None: $JAXLLM_BPE_DIR, then tiktoken's cache

    GPT2_VOCAB: ClassVar[int] = 50257  # ids in the token files


@dataclass(frozen=True)
class TranslationConfig(Section):
    """Parallel text for `src <eos_src> tgt <eos_tgt>` training (jaxllm.data.translation).

    Files: each entry is a path prefix P naming `P.<src_lang>` and `P.<tgt_lang>`, relative to
    $JAXLLM_DATA_DIR when it is set. With `hf_dataset`, train/valid/test are split names of that
    Hugging Face dataset instead (rows {"translation": {src_lang: ..., tgt_lang: ...}})."""

    PATH: ClassVar[str] = "data.translation"

    src_lang: str = spec("de", nonempty=True)
    tgt_lang: str = spec("en", nonempty=True)
    train: tuple[str, ...] = ("multi30k_de_en/train",)  # prefixes, concatenated in order
    valid: str = spec("multi30k_de_en/val", nonempty=True)
    test: str = spec("multi30k_de_en/test", nonempty=True)
    hf_dataset: str | None = None  # e.g. bbaaaa/iwslt14-de-en-preprocess (needs hub access)
    vocab_size: int = spec(10_000, ge=300)  # byte-level BPE trained on the training pairs
    # The course's length filter: keep a pair if len(src.split()) + len(tgt.split()) < max_words
    # (all splits). Pairs whose layout exceeds model.context_length are dropped too, counted.
    max_words: int | None = spec(None, gt=0)
    test_limit: int | None = spec(None, gt=0)  # score only the first N test pairs (course: 100)
    pad_multiple: int = spec(16, gt=0)  # batch length rounded up: few shapes, few recompiles
    beam_width: int = spec(1, ge=1)  # 1: greedy
    length_penalty: float = spec(1.0, ge=0.0, le=10.0)  # GNMT's alpha for beam search (<= 10)
    bleu_split: Literal["valid", "test"] = "valid"  # scored with BLEU after every epoch


@dataclass(frozen=True)
class DataConfig(Section):
    PATH: ClassVar[str] = "data"

    kind: Literal["associative_recall", "tokens", "translation"] = "associative_recall"
    associative_recall: AssociativeRecallConfig = field(default_factory=AssociativeRecallConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    translation: TranslationConfig = field(default_factory=TranslationConfig)


@dataclass(frozen=True)
class OptimConfig(Section):
    PATH: ClassVar[str] = "optim"

    lr: float = spec(3e-4, gt=0.0)  # peak learning rate, reached at the end of warm-up
    min_lr: float = spec(3e-5, ge=0.0)  # reached exactly at the last step; <= lr
    warmup_steps: int = spec(100, ge=0)
    beta1: float = spec(0.9, ge=0.0, lt=1.0)
    beta2: float = spec(0.95, ge=0.0, lt=1.0)
    eps: float = spec(1e-8, gt=0.0)
    weight_decay: float = spec(0.1, ge=0.0)
    decay_norms_and_embeddings: bool = False  # weight decay on norm scales, biases, embeddings
    grad_clip: float = spec(1.0, ge=0.0)  # global-norm clipping; 0 disables

    def _check(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")


@dataclass(frozen=True)
class TrainConfig(Section):
    PATH: ClassVar[str] = "train"

    seed: int = spec(0, ge=0)
    batch_size: int = spec(64, gt=0)
    # The run's length: `steps`, or `epochs` over a data source that has epochs (translation);
    # exactly one is set. With epochs, evaluation runs at the end of every epoch.
    steps: int | None = spec(1000, gt=0)
    epochs: int | None = spec(None, gt=0)
    eval_every: int | None = spec(200, gt=0)  # steps between evaluations (and at the end)
    eval_batches: int = spec(16, gt=0)  # held-out batches per evaluation (token data)
    log_every: int = spec(10, gt=0)
    run_dir: str = spec("runs/default", nonempty=True)
    checkpoint_every: int = spec(0, ge=0)  # 0: only at the end
    keep_checkpoints: int = spec(3, gt=0)  # the last K; the best by eval loss is kept apart
    resume: bool = True  # continue from run_dir's latest checkpoint if there is one
    # Resuming with settings that change the result (model, data, optimizer, schedule, seed)
    # is refused with the list of differences, unless this is true.
    allow_config_change: bool = False
    progress: bool = True  # tqdm bar
    # [start, end]: record a jax.profiler trace (TensorBoard / Perfetto) of updates start ..
    # end - 1, numbered as in the log (the n-th update is step n), into RUN_DIR/trace/.
    trace_steps: tuple[int, ...] | None = None

    # What may differ when a run resumes: how it is watched and kept, not what it computes.
    NO_EFFECT: ClassVar[tuple[str, ...]] = (
        "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
        "resume", "allow_config_change", "progress", "run_dir", "trace_steps",
    )  # fmt: skip

    def _check(self) -> None:
        if self.trace_steps is None:
            return
        if len(self.trace_steps) != 2:
            raise ConfigError(
                f"train.trace_steps must be [start, end] (two steps) or null, got "
                f"{list(self.trace_steps)}"
            )
        start, end = self.trace_steps
        if not 1 <= start < end:
            raise ConfigError(
                "train.trace_steps must be [start, end] with 1 <= start < end, got "
                f"[{start}, {end}]"
            )
        if self.steps is not None and end > self.steps + 1:
            raise ConfigError(
                f"train.trace_steps end must be <= train.steps + 1 = {self.steps + 1} (the trace "
                f"covers steps start .. end - 1), got [{start}, {end}]"
            )


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How the run spreads over devices: a mesh of `data` x `fsdp` x `pipeline`
    (jaxllm/parallel.py builds it). The batch is split over data and fsdp; parameters and
    optimizer state are replicated over `data` and sharded over `fsdp` (ZeRO-3). `pipeline` > 1
    cuts the block stack into that many stages of consecutive layers (GPipe, jaxllm/pipeline.py;
    needs execution.scan_layers; `virtual_stages` > 1: the circular schedule), each data x fsdp
    shard of the batch into `microbatches`. The
    product of the three must equal the device count; -1 (at most one axis) fills it, so the
    defaults run unchanged on 1 or N devices as plain data parallelism. Like `execution`, the
    layout is how a run computes, free to change on a resume: the same function up to float
    reduction order, and with execution.dropout > 0 other masks (fsdp, pipeline and
    microbatches each draw their own per layer / microbatch). With several processes the
    devices are those of all of them (`jax.devices()`)."""

    PATH: ClassVar[str] = "parallel"

    data: int = spec(-1, ge=-1)
    fsdp: int = spec(1, ge=-1)
    pipeline: int = spec(1, ge=-1)  # pipeline stages; > 1 needs execution.scan_layers
    # GPipe microbatches per data x fsdp shard of the batch; the bubble is (S - 1) / (M + S - 1)
    # of a step. None: as many as stages (M = S). Unused when the mesh has pipeline = 1.
    microbatches: int | None = spec(None, ge=1)
    # Layer chunks per stage, V: 1 is GPipe; V > 1 the circular schedule (each microbatch goes
    # round the stages V times), bubble (S - 1) / (V M + S - 1); needs pipeline > 1, M >= S
    # and n_layers divisible by pipeline x V.
    virtual_stages: int = spec(1, ge=1)
    # Several processes (hosts), started with jax.distributed (jaxllm/distributed.py): all
    # three, or none. None: from $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES /
    # $JAX_PROCESS_ID, else a Slurm or Open MPI launch of more than one task, else one process.
    coordinator_address: str | None = spec(None, nonempty=True)  # "host:port" of process 0
    num_processes: int | None = spec(None, ge=1)
    process_id: int | None = spec(None, ge=0)  # 0 .. num_processes - 1; 0 starts the service

    AXES: ClassVar[tuple[str, ...]] = ("data", "fsdp", "pipeline")

    def _check(self) -> None:
        if self.coordinator_address is not None:
            host, colon, port = self.coordinator_address.rpartition(":")
            if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
                raise ConfigError(
                    "parallel.coordinator_address must be HOST:PORT with a port in [1, 65535] "
                    f"(process 0's address), got {self.coordinator_address!r}"
                )
        n, i = self.num_processes, self.process_id
        if n is not None and i is not None and i >= n:
            raise ConfigError(
                f"parallel.process_id must be in [0, parallel.num_processes - 1 = {n - 1}], got {i}"
            )
        sizes = {a: getattr(self, a) for a in self.AXES}
        for axis, n in sizes.items():
            if n == 0:
                raise ConfigError(f"parallel.{axis} must be >= 1 or -1 (fill), got 0")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(
                f"at most one of parallel.{', parallel.'.join(self.AXES)} may be -1 (fill the "
                f"devices), got {sizes}"
            )


@dataclass(frozen=True)
class Config(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def _check(self) -> None:
        m, t = self.model, self.train
        if (t.steps is None) == (t.epochs is None):
            raise ConfigError(
                f"set exactly one of train.steps ({t.steps}) and train.epochs ({t.epochs}); "
                "the other must be null"
            )
        if t.epochs is not None:
            if self.data.kind != "translation":
                raise ConfigError(
                    f"train.epochs needs data with epochs (kind translation), not {self.data.kind}"
                    "; use train.steps"
                )
            if t.eval_every is not None:
                raise ConfigError(
                    "train.eval_every must be null with train.epochs: evaluation runs at the "
                    "end of every epoch"
                )
        elif t.eval_every is None:
            raise ConfigError("train.eval_every must be set (> 0) when training by train.steps")
        if t.steps is not None and self.optim.warmup_steps >= t.steps:
            raise ConfigError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) must be < train.steps "
                f"({self.train.steps})"
            )
        p = self.parallel
        if p.data > 0 and p.fsdp > 0 and t.batch_size % (p.data * p.fsdp):
            raise ConfigError(
                f"train.batch_size ({t.batch_size}) must be divisible by parallel.data x "
                f"parallel.fsdp = {p.data * p.fsdp}: the batch is split over both"
            )
        if self.data.kind == "associative_recall":
            ar = self.data.associative_recall
            if m.vocab_size < ar.vocab_size:
                raise ConfigError(
                    f"model.vocab_size ({m.vocab_size}) must be >= "
                    f"data.associative_recall.vocab_size ({ar.vocab_size})"
                )
            if m.context_length < 2 * ar.num_pairs + 1:
                raise ConfigError(
                    f"model.context_length ({m.context_length}) must be >= "
                    f"2 * num_pairs + 1 = {2 * ar.num_pairs + 1}"
                )
        elif self.data.kind == "translation" and m.vocab_size < self.data.translation.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({m.vocab_size}) must be >= data.translation.vocab_size "
                f"({self.data.translation.vocab_size}), the tokenizer's size"
            )
        elif self.data.kind == "tokens" and m.vocab_size < TokensConfig.GPT2_VOCAB:
            raise ConfigError(
                f"token files use the GPT-2 vocabulary ({TokensConfig.GPT2_VOCAB} ids); "
                f"model.vocab_size is {m.vocab_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_changes(old: Config, new: Config) -> list[str]:
    """'section.key: old -> new' for every field that differs and changes what a run computes
    (TrainConfig.NO_EFFECT fields, `execution` but its OBJECTIVE and the device layout,
    `parallel`, are left out: a run saved on 8 devices with Pallas kernels may continue on 1 with
    XLA's)."""

    def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
        return out

    a, b = flat(old.to_dict()), flat(new.to_dict())
    skip = {f"train.{k}" for k in TrainConfig.NO_EFFECT}
    how = {f.name for f in dataclasses.fields(ExecutionConfig)} - set(ExecutionConfig.OBJECTIVE)
    skip |= {f"execution.{k}" for k in how}
    skip |= {f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)}
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if k not in skip and a.get(k) != b.get(k)]  # fmt: skip


# ----------------------------------------------------------------------------- parsing


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, checking every key (values: on construction)."""
    if not isinstance(data, dict):
        got = _shown(data) if data is None else type(data).__name__
        raise ConfigError(f"{path or 'config'} must be a mapping, got {got}")
    if cls is Config:
        data = _execution_out_of_model(data)
    if cls is ExecutionConfig and "loss_backend" in data:  # its name in earlier run dirs
        data = {("kernel_backend" if k == "loss_backend" else k): v for k, v in data.items()}
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = path or "top level"
        raise ConfigError(f"unknown key(s) {unknown} at {where}; valid keys: {names}")
    return cls(**data)


def _execution_out_of_model(tree: dict[str, Any]) -> dict[str, Any]:
    """A config written when `model` held the execution fields too (run dirs and checkpoints
    of earlier versions, old presets): those fields move to `execution`."""
    model = tree.get("model")
    names = {f.name for f in dataclasses.fields(ExecutionConfig)}
    if not isinstance(model, dict) or not names & model.keys():
        return tree
    moved = {k: v for k, v in model.items() if k in names}
    execution = tree.get("execution") or {}
    if not isinstance(execution, dict) or execution.keys() & moved.keys():
        both = sorted(moved.keys() & execution.keys()) if isinstance(execution, dict) else []
        raise ConfigError(f"{both or sorted(moved)} set in both model and execution")
    rest = {k: v for k, v in model.items() if k not in names}
    return {**tree, "model": rest, "execution": {**execution, **moved}}


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else from_dict(tp, value, path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {list(allowed)}, got {_shown(value)}")
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
    if origin is tuple:  # tuple[X, ...]: a YAML list
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"{path} must be a non-empty list, got {_shown(value)}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {_shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {_shown(value)}")
        return int(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {_shown(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {_shown(value)}")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")  # schema bug, not user error


def _shown(value: Any) -> str:
    """A bad value as an error message shows it (YAML reads '', ' ' and '~' as null)."""
    return "nothing (an empty or null value)" if value is None else repr(value)


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
            if re.match(r"--[A-Za-z]", args[i + 1]):  # the next override, not a value
                raise ConfigError(
                    f"override --{key} has no value (next: {args[i + 1]!r}; a value that starts "
                    f"with -- is given as --{key}=VALUE)"
                )
            i += 1
            raw = args[i]
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override --{key}: cannot parse {raw!r} ({e})") from None
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
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(keys[: depth + 1])} must be a mapping")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML preset (or the defaults), apply CLI overrides, validate, return a Config."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if loaded is None or loaded == {}:  # the defaults alone are no job (GPT-2 124M, AR data)
            raise ConfigError(f"{path} is empty: a preset sets at least model and data (configs/)")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a YAML mapping at the top level")
        tree = _execution_out_of_model(loaded)
    for dotted, value in parse_overrides(overrides or []).items():
        _set_path(tree, dotted, value)
    return from_dict(Config, tree)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML (temp name, then rename), loadable by `load_config`."""
    write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
