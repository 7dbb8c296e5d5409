"""The decoder shell every architecture shares: block stack, final norm, LM head, loss, KV cache.

An architecture file (gpt2.py, transformer_lm.py) subclasses `Decoder` and writes only what
differs: `setup` builds its embeddings and calls `self.build_stack(block, norm)`, `embed` maps
tokens to the residual stream. Blocks follow one contract: `block(x, h, inputs, cache) ->
(x, h, cache)`, the residual stream being x + h with h the block's last branch output, so every
residual add happens inside the next norm (`add_and_norm`), the final one inside `ln_f` here.

Three entry points, one per use (`model.apply(variables, ..., method=...)`):
  __call__(tokens)                        -> logits (B, T, V)                (init, analysis)
  loss(tokens, targets)                   -> (mean loss, {loss_sum, correct, count})  (training)
  decode(tokens, cache, cache_index, ...) -> (logits, cache)                 (generation)

Named scopes (what the profiler's trace viewer and the HLO op names show). Flax's automatic
per-module scopes are turned off inside the entry points, so every op sits under exactly one of
these paths (i = 0 .. n_layers - 1, the block whose parameters are h{i}):
  embed                  token (+ position) embedding
  block_{i}/ln_1         the pending residual add + the first norm (ln1)
  block_{i}/conv         the short causal conv (model.short_conv only)
  block_{i}/attn/qkv     q/k/v projection (+ RoPE)
  block_{i}/attn/sdpa    softmax(q k^T / sqrt(Dh) + mask) v (+ the KV-cache write when decoding)
  block_{i}/attn/out     output projection (+ dropout)
  block_{i}/ln_2         residual add + the second norm (ln2)
  block_{i}/mlp          the MLP (GELU or SwiGLU)
  ln_f                   the last residual add + final norm
  loss                   LM head + cross-entropy (the `loss` method)
  lm_head                logits (`__call__`, `decode`)
  optimizer              gradient clipping + the AdamW update (jaxllm.train.state.train_step)
Under a transformation the names are prefixed, e.g. `jit(train_step)/jvp(GPT2.loss)/block_3/
attn/qkv/dot_general` (forward) and `transpose(jvp(GPT2.loss))/block_3/...` (backward); with
execution.remat "block" the backward's ops carry `.../block_3/checkpoint/attn/...` and the
recomputed forward `.../checkpoint/rematted_computation/attn/...` (`profile.py trace` prints
these as fwd/, bwd/ and recompute/block_3/attn/...). Scopes rename ops only: the compiled
program is the same.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import ops
from jaxllm.config import ExecutionConfig, ModelConfig
from jaxllm.functional import IGNORE
from jaxllm.layers import AttentionInputs, Embedding, Initializer, KVCache, LMHead, add_and_norm

Sums = dict[str, jax.Array]  # {loss_sum, correct, count}: add up exactly over batches
Carry = tuple[jax.Array, jax.Array]  # (x, h): the residual stream and the pending branch output


@dataclasses.dataclass(frozen=True)
class BlockRunner:
    """Runs a model's block stack in place of its own loop or `nn.scan` (`Decoder.loss(...,
    blocks=runner)`): `run(layer_fn, layers, carry, rng=key) -> carry`, where
    `layer_fn(layer_params, carry[, key])` applies one layer (remat and all) and `layers` is
    params["blocks"] (execution.scan_layers: leaves (L, ...), a layer is a slice) or the list
    of the unrolled blocks' parameters [params["h0"], ...]. With dropout, `rng` is a key of
    the blocks' own and `run` passes each layer (and microbatch) a key of its own (e.g.
    `fold_in(rng, layer)`); else rng is None.
    jaxllm.parallel runs the layers gathering each one's weights (fsdp), jaxllm.pipeline as
    pipeline stages. `per_device`: `run` calls layer_fn inside its own shard_map, on per-device
    arrays, so the layers' Pallas calls run as they are (no KernelShard)."""

    run: Callable[..., Carry]
    per_device: bool = False


def explicit_scopes(method: Callable) -> Callable:
    """Run an entry point with Flax's automatic module-name scopes off (trace time only), so the
    trace shows the scope names listed in the module docstring and nothing between them."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with nn.override_named_call(False):
            return method(*args, **kwargs)

    return wrapper


class Decoder(nn.Module):
    cfg: ModelConfig
    execution: ExecutionConfig = ExecutionConfig()
    # Set by jaxllm.parallel on a mesh of several devices (a clone of the model): how the Pallas
    # kernels run there (per batch shard). None: one device.
    kernel_shard: ops.KernelShard | None = None

    @property
    def plan(self) -> ops.OpPlan:
        """The op paths this model takes (jaxllm.ops); blocks and norms get them from here."""
        return ops.plan_ops(self.cfg, self.execution, shard=self.kernel_shard)

    # ------------------------------------------------------------ what an architecture writes

    def embed(self, tokens: jax.Array, positions: jax.Array, deterministic: bool) -> jax.Array:
        """tokens (B, T) int, positions (B, T) -> embeddings (B, T, D) float32 (`stream` casts)."""
        raise NotImplementedError

    def stream(self, tokens: jax.Array, positions: jax.Array, deterministic: bool) -> jax.Array:
        """The residual stream entering the first block: `embed`, in execution.residual_dtype."""
        return self.embed(tokens, positions, deterministic).astype(self.execution.residual_dtype)

    def build_stack(
        self,
        token_embedding: Embedding,
        block: Callable[..., nn.Module],
        norm: Callable[..., nn.Module],
        head_init: Initializer,
    ) -> None:
        """Called from an architecture's `setup`: the n_layers blocks h0, h1, ... (`block(cfg,
        execution, plan, name=...)`), the final norm ln_f (`norm()`) and, when untied, lm_head.
        With execution.remat "block", each block is rematerialised: the backward pass recomputes its
        forward from its inputs (jax.checkpoint saving nothing inside the block)."""
        cfg, ex = self.cfg, self.execution
        if ex.remat == "block":
            # Under scan every layer is one body anyway: no CSE across layers to prevent.
            nothing = jax.checkpoint_policies.nothing_saveable
            block = nn.remat(block, policy=nothing, prevent_cse=not ex.scan_layers)
        self.token_embedding = token_embedding
        if ex.scan_layers:
            stack = nn.scan(
                _ScanLayer,
                variable_axes={"params": 0},  # every leaf gets a leading (n_layers,) axis
                split_rngs={"params": True, "dropout": True},  # own init and dropout per layer
                in_axes=(nn.broadcast, 0),  # inputs shared, cache sliced per layer
                length=cfg.n_layers,
            )
            self.blocks = stack(cfg, ex, self.plan, block, name="blocks")
        else:
            self.blocks = [block(cfg, ex, self.plan, name=f"h{i}") for i in range(cfg.n_layers)]
        self.ln_f = norm()
        if not cfg.tie_embeddings:
            dtype = jnp.dtype(ex.compute_dtype)
            self.lm_head = LMHead(cfg.vocab_size, cfg.d_model, head_init, dtype, name="lm_head")

    # ------------------------------------------------------------ the shared part

    def hidden(
        self,
        tokens: jax.Array,
        inputs: AttentionInputs,
        cache: list[KVCache] | KVCache | None = None,
        blocks: BlockRunner | None = None,
    ) -> tuple[jax.Array, list[KVCache] | KVCache | None]:
        """tokens (B, T) -> final normed hidden states (B, T, D) in compute dtype, new caches.
        `blocks`: run the block stack with it instead of the model's own loop or scan (no
        cache)."""
        with jax.named_scope("embed"):
            x = self.stream(tokens, inputs.positions, inputs.deterministic)  # (B, T, D)
        h = None  # the pending branch output: nothing before block 0
        if self.execution.scan_layers:  # one scanned body: a carry of fixed type
            h = jnp.zeros(x.shape, jnp.dtype(self.execution.compute_dtype))  # x + 0 == x exactly
        if blocks is not None:  # one layer's parameters at a time, as the runner says
            with jax.named_scope("blocks"):
                x, h = self.run_blocks(blocks, (x, h), inputs.deterministic)
        elif self.execution.scan_layers:
            with jax.named_scope("blocks"):
                (x, h), cache = self.blocks((x, h), inputs, cache)
        else:
            new_cache = []
            for i, block in enumerate(self.blocks):
                with jax.named_scope(f"block_{i}"):
                    x, h, layer_cache = block(x, h, inputs, None if cache is None else cache[i])
                new_cache.append(layer_cache)
            cache = None if cache is None else new_cache
        with jax.named_scope("ln_f"):
            _, x = add_and_norm(self.ln_f, x, h)  # the last pending residual add
        return x, cache

    def run_blocks(self, runner: BlockRunner, carry: Carry, deterministic: bool) -> Carry:
        """The block stack run by `runner`: the layer body of `self.blocks` applied to one
        layer's parameters at a time: slices of params["blocks"] (execution.scan_layers), or
        the list params["h0"], params["h1"], ... (unrolled; carry (x, None) before block 0)."""
        plan = dataclasses.replace(self.plan, shard=None) if runner.per_device else self.plan
        params = self.variables["params"]
        scanned = self.execution.scan_layers
        if scanned:
            body = _ScanLayer(self.cfg, self.execution, plan, self.blocks.block, parent=None)
            layers = params["blocks"]
        else:
            body = self.blocks[0].clone(parent=None, plan=plan)  # a block, unbound
            layers = [params[f"h{i}"] for i in range(self.cfg.n_layers)]

        def layer_fn(layer_params: Any, carry: Carry, key: jax.Array | None = None) -> Carry:
            b, t = carry[0].shape[:2]  # a microbatch's own rows
            inputs = AttentionInputs(jnp.broadcast_to(jnp.arange(t), (b, t)), deterministic)
            rngs = None if key is None else {"dropout": key}
            if scanned:
                return body.apply({"params": layer_params}, carry, inputs, None, rngs=rngs)[0]
            return body.apply({"params": layer_params}, *carry, inputs, None, rngs=rngs)[:2]

        dropout = not deterministic and self.execution.dropout > 0  # no rng given: flax says so
        rng = self.make_rng("dropout") if dropout else None
        return runner.run(layer_fn, layers, carry, rng=rng)

    def head_matrix(self) -> jax.Array:
        """The LM head as (V, D): the token table when tied."""
        return self.token_embedding.table if self.cfg.tie_embeddings else self.lm_head.kernel.T

    def logits(self, x: jax.Array) -> jax.Array:
        """(B, T, D) -> (B, T, V) in compute dtype (the loss and the sampler upcast)."""
        with jax.named_scope("lm_head"):
            if self.cfg.tie_embeddings:
                return self.token_embedding.attend(x, jnp.dtype(self.execution.compute_dtype))
            return self.lm_head(x)

    @explicit_scopes
    def __call__(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        """tokens (B, T) int -> logits (B, T, V)."""
        check_tokens(tokens, self.cfg)
        x, _ = self.hidden(tokens, AttentionInputs(default_positions(tokens), deterministic))
        return self.logits(x)

    @explicit_scopes
    def loss(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        deterministic: bool = True,
        blocks: BlockRunner | None = None,
    ) -> tuple[jax.Array, Sums]:
        """tokens, targets (B, T) int (IGNORE = -1: no loss) -> (mean loss over the counted
        targets, sums). On the Pallas loss path the (B, T, V) logits are never formed.
        `blocks`: how the block stack runs (jaxllm.parallel)."""
        check_tokens(tokens, self.cfg)
        check_targets(targets, tokens, self.cfg)
        inputs = AttentionInputs(default_positions(tokens), deterministic)
        x, _ = self.hidden(tokens, inputs, blocks=blocks)
        smoothing = 0.0 if deterministic else self.execution.label_smoothing
        with jax.named_scope("loss"):
            head, plan = self.head_matrix(), self.plan
            return lm_loss(x, head, targets, self.execution, plan.loss, smoothing, plan.shard)

    @explicit_scopes
    def decode(
        self,
        tokens: jax.Array,
        cache: list[KVCache] | KVCache,
        cache_index: jax.Array | int,
        positions: jax.Array | None = None,
        key_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, list[KVCache] | KVCache]:
        """One decoding step (or the prefill): tokens (B, T) written to cache slots
        cache_index .. cache_index + T - 1 -> (logits (B, T, V), new cache). positions (B, T)
        default to the slots; key_mask (B, S) hides padding slots."""
        check_tokens(tokens, self.cfg, allow_empty=True)
        if self.cfg.short_conv:
            raise ValueError(
                "model.short_conv models have no convolution state in the KV cache yet: decode "
                "with jaxllm.generate.generate_uncached"
            )
        check_cache_write(cache, cache_index, tokens.shape[1])
        if positions is None:
            positions = default_positions(tokens, cache_index)
        _check_id_range("positions", positions, 0, self.cfg.context_length, "context_length")
        inputs = AttentionInputs(positions, True, key_mask, cache_index)
        x, cache = self.hidden(tokens, inputs, cache)
        return self.logits(x), cache


class _ScanLayer(nn.Module):
    """One layer as `nn.scan` wants it: (carry (x, h), inputs, cache) -> ((x, h), cache)."""

    cfg: ModelConfig
    execution: ExecutionConfig
    plan: ops.OpPlan
    block: Callable[..., nn.Module]

    @nn.compact
    def __call__(
        self, carry: tuple[jax.Array, jax.Array], inputs: AttentionInputs, cache: KVCache | None
    ) -> tuple[tuple[jax.Array, jax.Array], KVCache | None]:
        block = self.block(self.cfg, self.execution, self.plan, name="block")
        x, h, cache = block(*carry, inputs, cache)
        return (x, h), cache


def read_dtypes(ex: ExecutionConfig) -> Callable[[Any], Any]:
    """For one block's parameters, the dtype each is read in: ex.compute_dtype for a Linear's
    kernel (jaxllm.layers.Linear casts it before its matmul; in a block every "kernel" outside
    the conv is a Linear's), None (as stored) for the rest. jaxllm.parallel gathers the
    compute-dtype ones already cast: half the bytes, the same values."""
    dtype = jnp.dtype(ex.compute_dtype)

    def read(path: Any, _: Any) -> Any:
        keys = [getattr(k, "key", None) for k in path]
        return dtype if keys[-1] == "kernel" and "conv" not in keys else None

    return lambda layer_params: jax.tree_util.tree_map_with_path(read, layer_params)


def stack_blocks(params: dict, n_layers: int) -> dict:
    """Unrolled parameters (h0 .. h{L-1}) -> the execution.scan_layers layout (blocks/block, every
    leaf stacked on a leading (L,) axis). The other entries are kept as they are."""
    layers = [params[f"h{i}"] for i in range(n_layers)]
    rest = {k: v for k, v in params.items() if not is_layer_name(k)}
    return rest | {"blocks": {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}}


def unstack_blocks(params: dict) -> dict:
    """The inverse of `stack_blocks`: blocks/block (leaves (L, ...)) -> h0 .. h{L-1}."""
    stacked = params["blocks"]["block"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "blocks"}
    return rest | {f"h{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)}


def is_layer_name(name: str) -> bool:
    """Whether `name` is an unrolled block's parameter entry (h0, h1, ...)."""
    return name.startswith("h") and name[1:].isdigit()


# ----------------------------------------------------------------------------- inputs, cache


def default_positions(tokens: jax.Array, start: jax.Array | int = 0) -> jax.Array:
    """(B, T) absolute positions start, ..., start + T - 1."""
    b, t = tokens.shape
    return jnp.broadcast_to(jnp.arange(t) + start, (b, t))


def check_tokens(tokens: jax.Array, cfg: ModelConfig, allow_empty: bool = False) -> None:
    """Raise ValueError for token ids the model cannot take.

    Shapes are static, so length is checked at trace time; ids are checked only when the
    array is concrete (outside jit), since a traced value has no contents yet.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (batch, time), got {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    t = tokens.shape[1]
    if t > cfg.context_length:
        raise ValueError(
            f"sequence length {t} exceeds the model's context_length {cfg.context_length}"
        )
    if t == 0 and not allow_empty:
        raise ValueError("sequence length must be >= 1")
    _check_id_range("token ids", tokens, 0, cfg.vocab_size)


def check_targets(targets: jax.Array, tokens: jax.Array, cfg: ModelConfig) -> None:
    """Targets have the tokens' shape and hold ids in [0, V) or IGNORE (-1)."""
    if targets.shape != tokens.shape:
        raise ValueError(f"targets shape {targets.shape} must equal tokens shape {tokens.shape}")
    _check_id_range("targets", targets, IGNORE, cfg.vocab_size)


def _concrete_range(ids: jax.Array | int) -> tuple[int, int] | None:
    """(min, max) of `ids` when its values are known (outside jit), else None."""
    if isinstance(ids, jax.core.Tracer) or not np.size(ids):
        return None
    try:
        return int(np.min(ids)), int(np.max(ids))
    except jax.errors.ConcretizationTypeError:  # e.g. under jax.eval_shape: nothing to check
        return None


def _check_id_range(what: str, ids: jax.Array, lo: int, hi: int, limit: str = "vocab_size") -> None:
    """`ids` in [0, hi) (or lo = IGNORE) when concrete; `limit` names the config field of hi."""
    got = _concrete_range(ids)
    if got is not None and (got[0] < lo or got[1] >= hi):
        extra = " or -1 (no loss)" if lo < 0 else ""
        raise ValueError(
            f"{what} must be in [0, {hi - 1}] ({limit} {hi}){extra}, got min {got[0]}, max {got[1]}"
        )


def check_cache_write(cache: list[KVCache] | KVCache, cache_index: jax.Array | int, t: int) -> None:
    """The slots cache_index .. cache_index + t - 1 lie inside the cache (a write past its end
    would be clamped onto the last slots), checked when cache_index is concrete."""
    first = jax.tree.leaves(cache)[0]  # (B, S, H, Dh), or (L, B, S, H, Dh) scanned
    slots = first.shape[-3]
    got = _concrete_range(cache_index)
    if got is not None and (got[0] < 0 or got[1] + t > slots):
        raise ValueError(
            f"cache_index {got[1] if got[0] >= 0 else got[0]} + {t} tokens must fit the cache's "
            f"{slots} slots: cache_index in [0, {slots - t}]"
        )


def init_kv_cache(model: Decoder, batch: int, length: int) -> list[KVCache] | KVCache:
    """Zeroed caches of `length` slots in the compute dtype: per layer k, v (B, S, H, Dh), or
    with execution.scan_layers one k, v (L, B, S, H, Dh) (batch on `cache_batch_axis`)."""
    cfg, ex = model.cfg, model.execution
    if not 1 <= length <= cfg.context_length:
        raise ValueError(f"cache length must be in [1, {cfg.context_length}], got {length}")
    shape = (batch, length, cfg.n_heads, cfg.head_dim)
    dtype = jnp.dtype(ex.compute_dtype)
    if ex.scan_layers:
        shape = (cfg.n_layers, *shape)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    return [
        {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.n_layers)
    ]


def cache_batch_axis(model: Decoder) -> int:
    """The batch axis of every array in `init_kv_cache`'s result (beam search gathers on it)."""
    return 1 if model.execution.scan_layers else 0


# ----------------------------------------------------------------------------- loss


def lm_loss(
    x: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    ex: ExecutionConfig,
    path: str,
    label_smoothing: float = 0.0,
    shard: ops.KernelShard | None = None,
) -> tuple[jax.Array, Sums]:
    """Mean next-token cross-entropy over the targets that are not IGNORE (label-smoothed when
    label_smoothing > 0; the sums always hold the plain cross-entropy).

    x (B, T, D) final hidden states; head (V, D) the LM-head matrix (logits = x head^T, in
    ex.compute_dtype); targets (B, T) int. Returns (loss, {loss_sum, correct, count}): sums
    over the batch, so metrics of several batches add up exactly; "correct" counts targets whose
    logit is the row's maximum (a tie with another id counts: the kernels decide it the same way
    in one pass; greedy decoding's argmax takes the lower id). `path` ("xla" | "pallas") and
    `shard` come from the OpPlan.
    """
    d = x.shape[-1]
    valid = (targets != IGNORE).reshape(-1)  # (N,)
    count = jnp.sum(valid)
    weights = valid / jnp.maximum(count, 1).astype(jnp.float32)
    safe = jnp.where(valid, targets.reshape(-1), 0)
    dtype = jnp.dtype(ex.compute_dtype)
    loss, ce, hit = ops.linear_cross_entropy(
        x.reshape(-1, d), head, safe, weights, dtype, path, label_smoothing, shard,
        chunk_mib=ex.loss_chunk_mib,
    )  # fmt: skip
    return loss, {
        "loss_sum": jnp.sum(jnp.where(valid, ce, 0.0)),
        "correct": jnp.sum(valid & hit),
        "count": count,
    }
