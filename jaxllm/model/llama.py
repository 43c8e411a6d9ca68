"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; with experts: Mixtral, Qwen2/3-MoE, OLMoE) over a
paged KV cache.

A pure function of (params, KV cache, step inputs): `CausalLM.apply` writes the step's
keys and values into the cache by slot and attends through
`pallas_kernels.ragged_paged_attention`. The whole `[L, ...]` cache is threaded through
the layers, and each layer reads and writes its part in place, never copying it.

Layers run one of two ways (`scan_layers`):
- scanned (`nn.scan` with parameters stacked `[L, ...]` under "layers"), the default:
  compile time does not grow with depth. The body gets the whole stacks and the layer index
  (`layers.Stacking`): on CPU, decode-sized matmuls read their layer's weights in place
  (`pallas_kernels.stacked_matmul`) where XLA would copy each slice out first;
- unrolled (a Python loop over "layers_0".."layers_{L-1}"), opt-in: one array per layer,
  ~3-4x the compile time per bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, NamedTuple, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

import pallas_kernels
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.model.layers import Dtype, Embed, GatedMLP, Linear, RMSNorm, Stacking, apply_rotary, rotary_cos_sin
from jaxllm.model.lora import LoRATiles
from jaxllm.model.moe import EXPERT_LOAD, SparseMoE, pack_experts, packs_expert_leaf
from jaxllm.model.quant import QUANT_LEAVES, QuantPlan, packs_quantized
from jaxllm.model.registry import LayerKind, ModelArch
from pallas_kernels import stacked_matmul
from pallas_kernels.stacked_matmul.quantized import FORMATS

# A step's input arrays: numpy as the host fills them, jax arrays inside the compiled step
ArrayT = TypeVar("ArrayT", Array, np.ndarray)


class StepInputs(NamedTuple, Generic[ArrayT]):
    """The flattened ragged batch of one engine step (docs/design.md, "One engine step")."""

    token_ids: Int[ArrayT, " T"]
    positions: Int[ArrayT, " T"]
    slot_mapping: Int[ArrayT, "G T"]  # per KV cache group: the cache slot of each token's K/V; padding → scratch
    cu_q_lens: Int[ArrayT, " S1"]  # sequence i owns rows cu_q_lens[i]:cu_q_lens[i+1]
    kv_lens: Int[ArrayT, " S"]  # context length of each sequence after this step
    block_tables: Int[ArrayT, "G S M"]  # per KV cache group (kv_cache_groups.py)
    num_seqs: Int[ArrayT, " 1"]
    logits_indices: Int[ArrayT, " R"]  # rows whose logits are wanted
    lora: LoRATiles | None = None  # the tokens grouped by LoRA adapter slot (model/lora.py); None: no adapters


def stack_name(first_layer: int, num_layers: int, end: int) -> str:
    """The parameter tree's name for the stack of layers first_layer..end-1: "layers" when it holds them all,
    "layers_from_N" for a run starting at layer N (a model whose layers are of several kinds)."""
    return "layers" if (first_layer, end) == (0, num_layers) else f"layers_from_{first_layer}"


def stack_start(name: str) -> int | None:
    """The first layer of the stack a parameter tree key names (`stack_name`'s inverse); None: not a stack."""
    if name == "layers":
        return 0
    prefix = "layers_from_"
    return int(name[len(prefix) :]) if name.startswith(prefix) else None


class KVCache(NamedTuple):
    k: Float[Array, "L N B Hkv D"]
    v: Float[Array, "L N B Hkv D"]


def norm(arch: ModelArch, dtype: Dtype, stacking: Stacking, name: str) -> RMSNorm:
    """An RMSNorm as the architecture has it (Gemma's scale by 1 + w)."""
    return RMSNorm(arch.rms_norm_eps, dtype, stacking, 1.0 if arch.gemma else 0.0, name=name)


class Attention(nn.Module):
    arch: ModelArch
    dtype: Dtype
    attention_backend: str
    stacking: Stacking = Stacking()
    sliding_window: int | None = None  # this layer's (`LayerKind`)
    kv_groups: KVCacheGroups | None = None  # None: one group, slot = layer

    def _kv_place(self, layer, batch: StepInputs[Array]):
        """(the cache slot, slot mapping and block tables) of this layer: those of its KV cache group."""
        groups = self.kv_groups
        if groups is None or groups.num_groups == 1:  # (one group: a slot per layer)
            return layer, batch.slot_mapping[0], batch.block_tables[0]
        group = jnp.asarray(groups.layer_groups, jnp.int32)[layer]
        slot = jnp.asarray(groups.layer_slots, jnp.int32)[layer]
        return slot, batch.slot_mapping[group], batch.block_tables[group]

    @nn.compact
    def __call__(self, x, cache: KVCache, layer, batch: StepInputs[Array], cos, sin):
        a, st = self.arch, self.stacking
        num_tokens = x.shape[0]
        # one matmul for q, k and v: per KV head, its group of q heads, then its k, then its v
        group = a.num_heads // a.num_kv_heads
        qkv = Linear(
            (a.num_kv_heads, group + 2, a.head_dim),
            shard_axis=0,
            dtype=self.dtype,
            bias=a.qkv_bias,
            stacking=st,
            parts_axis=1,
            name="qkv_proj",
        )(x, layer, batch.lora)
        q = qkv[:, :, :group].reshape(num_tokens, a.num_heads, a.head_dim)
        k, v = qkv[:, :, group], qkv[:, :, group + 1]
        if a.qk_norm_whole:  # OLMoE: each norm over the whole projection, all heads at once
            q = norm(a, self.dtype, st, "q_norm")(q.reshape(num_tokens, -1), layer)
            k = norm(a, self.dtype, st, "k_norm")(k.reshape(num_tokens, -1), layer)
            q, k = q.reshape(num_tokens, a.num_heads, a.head_dim), k.reshape(num_tokens, a.num_kv_heads, a.head_dim)
        elif a.qk_norm:
            q = norm(a, self.dtype, st, "q_norm")(q, layer)
            k = norm(a, self.dtype, st, "k_norm")(k, layer)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        slot, slot_mapping, block_tables = self._kv_place(layer, batch)
        cache = KVCache(
            *pallas_kernels.write_kv(cache.k, cache.v, k, v, slot_mapping, layer=slot, backend=self.attention_backend)
        )
        out = pallas_kernels.ragged_paged_attention(
            q,
            cache.k,
            cache.v,
            batch.kv_lens,
            block_tables,
            batch.cu_q_lens,
            batch.num_seqs,
            sm_scale=(a.gemma.query_pre_attn_scalar if a.gemma else a.head_dim) ** -0.5,
            sliding_window=self.sliding_window,
            soft_cap=a.gemma.attn_softcap if a.gemma else None,
            sinks=st.at(st.param(self, "sinks", nn.initializers.zeros, (None,), (a.num_heads,), jnp.float32), layer)
            if a.attention_sinks
            else None,
            layer=slot,
            backend=self.attention_backend,
        )
        out = out.reshape(num_tokens, a.num_heads * a.head_dim)
        o_proj = Linear((a.hidden_size,), shard_axis=None, dtype=self.dtype, bias=a.o_bias, stacking=st, name="o_proj")
        return o_proj(out, layer, batch.lora), cache


class DecoderLayer(nn.Module):
    """One pre-norm block; the scan's body. Carry: (hidden, cache, layer index). `kind`: its MLP's."""

    arch: ModelArch
    dtype: Dtype
    attention_backend: str
    stacking: Stacking = Stacking()
    kind: LayerKind = LayerKind()
    expert_mesh: Mesh | None = None  # expert parallelism: the mesh the experts are split over
    kv_groups: KVCacheGroups | None = None  # where each layer's K/V lives (`Attention`)

    @nn.compact
    def __call__(self, carry, batch: StepInputs[Array], cos, sin):
        hidden, cache, layer = carry
        st = self.stacking
        window, groups = self.kind.sliding_window, self.kv_groups
        attention = Attention(self.arch, self.dtype, self.attention_backend, st, window, groups, name="self_attn")
        a, dtype = self.arch, self.dtype
        attn_out, cache = attention(norm(a, dtype, st, "input_layernorm")(hidden, layer), cache, layer, batch, cos, sin)
        if a.gemma:  # Gemma: a norm after attention, and one on each side of the MLP
            hidden = hidden + norm(a, dtype, st, "post_attention_layernorm")(attn_out, layer)
            mlp_in = norm(a, dtype, st, "pre_feedforward_layernorm")(hidden, layer)
        else:
            hidden = hidden + attn_out
            mlp_in = norm(a, dtype, st, "post_attention_layernorm")(hidden, layer)
        if self.kind.experts:  # (the step's real tokens: routing metrics count no padding row)
            moe = SparseMoE(self.arch, self.dtype, st, self.expert_mesh, name="mlp")
            mlp_out = moe(mlp_in, layer, batch.cu_q_lens[batch.num_seqs[0]])
        else:
            mlp_out = GatedMLP(self.arch, self.dtype, st, name="mlp")(mlp_in, layer, batch.lora)
        if a.gemma:
            mlp_out = norm(a, dtype, st, "post_feedforward_layernorm")(mlp_out, layer)
        return (hidden + mlp_out, cache, layer + 1), None


def expert_loads(intermediates) -> Int[Array, "Ls E"]:
    """Each sparse layer's tokens per expert in one step, in layer order, from what its layers sowed
    (`apply(..., mutable=["intermediates"])`; scanned runs sow `[L_run, E]`, unrolled layers `[E]`)."""
    rows = []
    for key, tree in intermediates.items():
        start = stack_start(key)
        start = int(key[len("layers_") :]) if start is None and key.startswith("layers_") else start
        if start is not None and EXPERT_LOAD in tree.get("mlp", {}):
            (load,) = tree["mlp"][EXPERT_LOAD]
            rows.append((start, jnp.reshape(load, (-1, load.shape[-1]))))
    return jnp.concatenate([load for _, load in sorted(rows, key=lambda r: r[0])])


class CausalLM(nn.Module):
    """`apply({"params": p}, cache, batch) -> (logits float32 [R, V], updated cache)`.

    `dtype`: the activations' (and a freshly initialised model's parameters'). Parameters stored in
    another dtype are read as they are: the CPU runner keeps bfloat16 weights for its bfloat16
    matmul kernel ("cpu_packed") and computes everything else in float32.
    """

    arch: ModelArch
    dtype: Dtype = jnp.float32
    attention_backend: str = "auto"
    scan_layers: bool = True
    matmul_backend: str = "auto"  # pallas_kernels.stacked_matmul's, for the scanned layers
    matmul_kernel_max_rows: int | None = None  # "cpu_packed": XLA's dot above this many rows (the self-check's)
    matmul_int8_min_rows: int = 0  # "cpu_packed": quantized weights' integer path from this many rows (the same's)
    quant: QuantPlan = QuantPlan()  # projections kept quantized (model/quant.py); empty: all float
    expert_mesh: Mesh | None = None  # expert parallelism: the step's mesh (the experts run under shard_map)
    expert_kernel: str | None = None  # "pallas": the experts' grouped matmul by the Pallas GPU kernel (`Stacking`)
    kv_groups: KVCacheGroups | None = None  # the cache's KV cache groups (None: one group, a slot per layer)
    # pipeline parallelism: a stage runs `arch.num_layers` of the model's layers; the first embeds the tokens,
    # the last applies the final norm and the LM head; the others take and return hidden states [T, H]
    first_stage: bool = True
    last_stage: bool = True
    # the pooling runner: "LAST", "MEAN" or "CLS" returns pooled hidden states [R, H] (float32) instead of logits
    pooling: str | None = None

    def packs_head(self) -> bool:
        """Whether "cpu_packed" reads the LM head (tied embedding or lm_head) packed too: whole panels, and an
        even hidden size (bfloat16 weights pair it; the runner picks "cpu_packed" for float32 or bfloat16 only)."""
        a = self.arch
        return (
            self.matmul_backend == "cpu_packed" and a.vocab_size % stacked_matmul.PANEL == 0 and a.hidden_size % 2 == 0
        )

    def pack_leaf(self, path: tuple[str, ...], value):
        """One leaf of the parameter tree as "cpu_packed" reads it (`stacked_matmul.pack`): a packable kernel of
        the stacked layers (float, or a quantized weight's arrays), and the LM head when `packs_head`; others as
        they are. Shapes unchanged. A weights `Layout`: each layer of a stack packs alone."""
        leaf, head = path[-1], path[-2:-1] in (("embed_tokens",), ("lm_head",))
        if any(k.startswith("experts_") for k in path):  # each expert packed alone (model/moe.py)
            return pack_experts(value) if packs_expert_leaf(leaf, value) else value
        if any("layers" in k for k in path[:-1]):
            if leaf == "kernel" and stacked_matmul.packable(value):
                return stacked_matmul.pack(value)
            return stacked_matmul.pack(value) if leaf in QUANT_LEAVES and packs_quantized(value.shape) else value
        if not self.packs_head() or not head:
            return value
        if leaf in QUANT_LEAVES:  # stored [K, V] as a kernel is; an untied embedding's table is only looked up
            untied_table = path[-2] == "embed_tokens" and not self.arch.tie_word_embeddings
            return value if untied_table else stacked_matmul.pack_matrix(value)
        if path[-2:] == ("embed_tokens", "embedding") and self.arch.tie_word_embeddings:
            return stacked_matmul.pack_matrix(value, transposed=True)
        if path[-2:] == ("lm_head", "kernel"):
            return stacked_matmul.pack_matrix(value)
        return value

    def pack(self, params):
        """`params` with every leaf packed by `pack_leaf` (abstract leaves stay as they are)."""

        def leaf(key_path, value):
            if not isinstance(value, (jax.Array, np.ndarray)):
                return value
            return self.pack_leaf(tuple(str(getattr(k, "key", "")) for k in key_path), value)

        return jax.tree_util.tree_map_with_path(leaf, params)

    def layer_stacking(self, num_layers: int | None, first_layer: int = 0) -> Stacking:
        return Stacking(
            num_layers,
            self.matmul_backend,
            self.matmul_kernel_max_rows,
            self.quant,
            first_layer,
            self.expert_kernel,
            self.matmul_int8_min_rows,
        )

    def head_int8_min_rows(self, name: str) -> int:
        """The LM head's integer path (x in 8 bits) only over 8-bit weights (the default model's Q8_0, the int8 head
        of `int8` and `int4`): at 64 rows it halves the head's time, a third of a decode step's matmuls, within the
        perplexity gate (docs/quantization.md); a 4-bit head keeps float x, its cost in perplexity not measured."""
        fmt = self.quant.get(name)
        return self.matmul_int8_min_rows if fmt and FORMATS[fmt].bits == 8 else 0

    @nn.compact
    def __call__(
        self, cache: KVCache, batch: StepInputs[Array], hidden: Array | None = None
    ) -> tuple[Float[Array, "R V"], KVCache]:
        """Logits of the rows `batch.logits_indices` names; a stage before the last returns its hidden states
        instead, and a stage after the first takes the previous stage's as `hidden`."""
        a = self.arch
        head_packed = self.packs_head()
        embed = Embed(
            a.vocab_size,
            a.hidden_size,
            self.dtype,
            head_packed and a.tie_word_embeddings,
            self.matmul_kernel_max_rows,
            self.quant.get("embed_tokens"),
            self.head_int8_min_rows("embed_tokens"),
            name="embed_tokens",
        )
        if self.first_stage:
            hidden = embed(batch.token_ids).astype(self.dtype)
            if a.gemma:  # scaled by sqrt(hidden), the factor rounded to the activations' type as transformers does
                hidden = hidden * jnp.asarray(a.hidden_size**0.5, self.dtype)
        assert hidden is not None, "a stage after the first takes the previous stage's hidden states"
        # (cos, sin) of full-attention layers, then of sliding-window ones (Gemma 3's have their own RoPE)
        rotary = [rotary_cos_sin(a, batch.positions, self.dtype)] * 2
        if a.gemma and a.gemma.local_rope:
            rotary[1] = rotary_cos_sin(a, batch.positions, self.dtype, a.gemma.local_rope)
        carry = (hidden, cache, jnp.int32(0))
        if self.scan_layers:
            # one scan per run of layers of one kind (the layer index in the carry runs on across them);
            # parameters are stacked [L, ...] by the layers themselves (Stacking) and handed whole to the body
            for start, end, kind in a.layer_runs():
                run = nn.scan(
                    DecoderLayer,
                    variable_broadcast="params",
                    variable_axes={"intermediates": 0},  # what layers sow (experts' loads), stacked per layer
                    split_rngs={"params": False},
                    in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                    length=end - start,
                )
                stacking = self.layer_stacking(end - start, start)
                name = stack_name(start, a.num_layers, end)
                layers = run(
                    a, self.dtype, self.attention_backend, stacking, kind, self.expert_mesh, self.kv_groups, name=name
                )
                carry, _ = layers(carry, batch, *rotary[kind.sliding_window is not None])
        else:
            for i in range(a.num_layers):
                stacking = self.layer_stacking(None)
                kind = a.layer_kind(i)
                layer = DecoderLayer(
                    a,
                    self.dtype,
                    self.attention_backend,
                    stacking,
                    kind,
                    self.expert_mesh,
                    self.kv_groups,
                    name=f"layers_{i}",
                )
                carry, _ = layer(carry, batch, *rotary[kind.sliding_window is not None])
        hidden, cache, _ = carry
        if not self.last_stage:
            return hidden, cache
        if self.pooling is not None:
            return pool_rows(self.pooling, norm(a, self.dtype, Stacking(), "norm")(hidden), batch), cache
        hidden = norm(a, self.dtype, Stacking(), "norm")(hidden[batch.logits_indices])
        if a.tie_word_embeddings:
            logits = embed.attend(hidden)
        else:
            head = Linear(
                (a.vocab_size,),
                shard_axis=0,
                dtype=self.dtype,
                bias=False,
                stacking=dataclasses.replace(
                    self.layer_stacking(None), int8_min_rows=self.head_int8_min_rows("lm_head")
                ),
                packed=head_packed,
                name="lm_head",
            )
            logits = head(hidden)
        logits = logits.astype(jnp.float32)
        if a.gemma and a.gemma.final_softcap:  # Gemma 2: logits → cap * tanh(logits / cap)
            logits = a.gemma.final_softcap * jnp.tanh(logits / a.gemma.final_softcap)
        return logits, cache


def pool_rows(pooling: str, hidden: Array, batch: StepInputs[Array]) -> Float[Array, "R H"]:
    """Per row (scheduled sequence) of the step, its tokens' hidden states (after the final norm) pooled in
    float32: LAST the row's last token, CLS its first, MEAN their sum (the host adds chunks and divides).
    Only these [R, H] floats leave the device."""
    rows = batch.logits_indices.shape[0]
    if pooling == "LAST":
        return hidden[batch.logits_indices].astype(jnp.float32)
    if pooling == "CLS":
        return hidden[jnp.minimum(batch.cu_q_lens[:rows], hidden.shape[0] - 1)].astype(jnp.float32)
    tokens = jnp.arange(hidden.shape[0], dtype=batch.cu_q_lens.dtype)
    segment = jnp.searchsorted(batch.cu_q_lens, tokens, side="right") - 1  # padding tokens: row `rows`, dropped
    return jax.ops.segment_sum(hidden.astype(jnp.float32), segment, num_segments=rows)
