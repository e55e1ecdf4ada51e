"""The target model: Kimi K2 / DeepSeek-V3 (MLA with YaRN, noaux_tc MoE with a shared expert).

Module names mirror the checkpoint's tensor names (`engine.models.layers.checkpoint_tensors`
lists them, with the shapes the checkpoint must have), and each layer is built with this rank's
share of the heads and intermediate dimensions (`tp`), so a rank loads only its pieces. Two
attention forms:

- `forward`: the MHA form (keys and values up-projected per head by `kv_b_proj`), causal, over
  the tokens and, for a later prefill chunk, its cached prefix (up-projected a bounded chunk at
  a time: `ops.prefill.mla_prefill`), through the attention backend's MHA pass (prefill,
  training);
- `verify`: the absorbed form over the latent cache (`kv_lora_rank + qk_rope_head_dim` values per
  token per layer), for any number of query tokens with an explicit visibility mask among them:
  decode is one query, the tree verify is `N` queries under the ancestor mask.

Under tensor parallelism (Megatron's split): query heads are split (`q_b_proj`, `kv_b_proj` by
output rows, `o_proj` by input columns) while the latent projections, their norms and the router
are replicated, so every rank holds the whole latent cache and routes identically; the dense
MLP, the shared expert and every routed expert split their intermediate dimension; two
all-reduces per layer (after `o_proj`, after the MLP or MoE output); embedding and LM head split
the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.dist import Group
from engine.models.layers import (
    MLP,
    ExpertBank,
    ParallelLMHead,
    RMSNorm,
    Stored,
    VocabParallelEmbedding,
    cast_parameters,
    checkpoint_tensors,
    linear,
)
from engine.weights import load_checkpoint
from ops.attention import PrefixKernel, absorbed_attention, joint_bias
from ops.moe import route_noaux_tc
from ops.prefill import TORCH_MHA, MHAPass, Prefix, mla_prefill
from ops.rope import rope_cos_sin, rope_frequencies, rope_tail

# (attention module, normed hidden states, layer index) -> (attention output, extra)
Attend = Callable[[Any, Tensor, int], tuple[Tensor, Any]]


# Whether this torch multiplies 16-bit matrices into fp32 (`aten::mm.dtype`, CUDA only).
MM_FP32_OUT = "dtype" in torch.ops.aten.mm.overloads()


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """`x [T, H]` times the router's `weight [E, H]` -> fp32 logits `[T, E]`. An fp32 weight:
    in fp32, as transformers computes them. A 16-bit one (`Router.narrow_`: the checkpoint's
    values exactly) multiplies the 16-bit inputs into fp32 on the tensor cores, which forms the
    products transformers' fp32 matmul of the same values forms and sums them in fp32, in
    another order (on the CPU, which has no such kernel, the same in fp32)."""
    if weight.dtype == torch.float32:
        return F.linear(x.float(), weight)
    x = x.to(weight.dtype)
    if x.device.type == "cpu":
        return F.linear(x.float(), weight.float())
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


class Router(nn.Module):
    # Scores in fp32 (as transformers does): its weight stays fp32 whatever the model dtype
    # (`cast_parameters`), so no step casts it; off the CPU a 16-bit model narrows it back to
    # the checkpoint's 16-bit values once loaded (`narrow_`), so no fp32 matmul runs.
    keep_fp32 = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        # NOTE: the correction bias only selects experts; it stays fp32 whatever the model dtype.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def narrow_(self, dtype: torch.dtype, check: bool = True) -> bool:
        """Keep the weight in the 16-bit `dtype` if it holds exactly that dtype's values (a
        checkpoint that stores its router in bf16, as Kimi's does), so `router_logits` runs
        16-bit inputs into fp32; returns whether it did. Reads the weight on the host: once,
        at load. Without `check` (a model on the meta device, which has no values) it narrows
        as a checkpoint storing the router in `dtype` would."""
        w = self.weight.data
        if dtype not in (torch.bfloat16, torch.float16) or w.dtype != torch.float32:
            return False
        narrow = w.to(dtype)
        if check and not torch.equal(narrow.float(), w):
            return False
        self.weight = nn.Parameter(narrow, requires_grad=False)
        return True

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`x [T, H]` -> chosen experts and their weights, both `[T, k]`."""
        c = self.cfg
        logits = router_logits(x, self.weight)
        return route_noaux_tc(logits, self.e_score_correction_bias, c.num_experts_per_tok,
                              c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)


def _rope_tail(x: Tensor, cos: Tensor, sin: Tensor, nope: int) -> Tensor:
    """`ops.rope.rope_tail`: one kernel off the CPU for 16-bit heads (`kimi::rope_tail`, which
    the meta device costs), the twin's ops on it."""
    if x.device.type != "cpu" and x.dtype != torch.float32:
        return torch.ops.kimi.rope_tail(x, cos, sin, nope)
    return rope_tail(x, cos, sin, nope)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: Group | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        where = cfg.source or "model config"
        if tp is not None:
            tp.divide(cfg.moe_intermediate_size, "moe_intermediate_size", where)
        q = cfg.quantization
        self.gate = Router(cfg)
        self.experts = ExpertBank(cfg.n_routed_experts, cfg.hidden_size,
                                  cfg.moe_intermediate_size, tp, cfg.expert_format(layer),
                                  q.group_size if q else 32, q.block_size if q else (128, 128))
        # NOTE: no reduce inside: routed and shared experts are summed, then reduced once.
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, tp,
                reduce=False, fp8=cfg.fp8_block) if cfg.n_shared_experts else None)

    def forward(self, x: Tensor, mode: str = "dense") -> Tensor:
        """`mode`: how the expert bank dispatches (`ExpertBank.forward`)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        idx, w = self.gate(x2)
        shared = None if self.shared_experts is None else self.shared_experts(x2)
        y = self.experts(x2, idx, w, mode, add=shared)
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y.view(shape)


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group | None = None):
        super().__init__()
        self.cfg = cfg
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh if tp is None else tp.divide(nh, "num_attention_heads",
                                                         cfg.source or "model config")
        f8 = cfg.fp8_block
        if cfg.q_lora_rank:
            self.q_a_proj = linear(H, cfg.q_lora_rank, fp8=f8)
            # NOTE: the config's epsilon, as vLLM and SGLang use (transformers hard-codes 1e-6
            # for the two latent norms; the models the parity tests build use 1e-6 throughout).
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, tp, 0, fp8=f8)
        else:
            self.q_proj = linear(H, nh * cfg.qk_head_dim, tp, 0, fp8=f8)
        self.kv_a_proj_with_mqa = linear(H, cfg.kv_cache_dim, fp8=f8)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        # NOTE: not kept FP8: every step absorbs it into the queries and values whole, so it is
        # dequantized once at load rather than in every layer of every step.
        self.kv_b_proj = linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                tp, 0)
        self.o_proj = linear(nh * cfg.v_head_dim, H, tp, 1, fp8=f8)
        self.scale = cfg.softmax_scale

    def latents(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """`x [..., H]` -> `q [..., heads, qk_head_dim]` (rope part rotated) and the cache row
        `[..., R + P]` (normalized `c_kv`, rotated `k_pe`)."""
        c = self.cfg
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(*x.shape[:-1], self.num_heads, c.qk_head_dim)
        q = _rope_tail(q, cos, sin, c.qk_nope_head_dim)
        kv = self.kv_a_proj_with_mqa(x)
        ckv = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        kpe = _rope_tail(kv[..., None, c.kv_lora_rank:], cos, sin, 0)[..., 0, :]
        return q, torch.cat([ckv, kpe], dim=-1)

    def forward_mha(self, x: Tensor, cos: Tensor, sin: Tensor, attend: MHAPass = TORCH_MHA,
                    prefix: Prefix | None = None) -> tuple[Tensor, Tensor]:
        """Causal attention over `x [B, T, H]` in the MHA form, after `prefix` (this layer's
        cached rows of the positions before `x`'s, up-projected in chunks) when given, each
        key set through the pass `attend`; also returns `x`'s cache rows `[B, T, R + P]`."""
        c = self.cfg
        dn, R = c.qk_nope_head_dim, c.kv_lora_rank
        q, row = self.latents(x, cos, sin)
        kvb = self.kv_b_proj(row[..., :R]).view(*x.shape[:-1], self.num_heads, dn + c.v_head_dim)
        o = mla_prefill(q, kvb[..., :dn], row[..., R:], kvb[..., dn:], self.scale, attend, prefix,
                        self.kv_b_proj)
        return self.o_proj(o.to(x.dtype).reshape(*x.shape[:-1], -1)), row

    def _absorb_weights(self) -> tuple[Tensor, Tensor]:
        c = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim,
                                       c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]  # W_UK, W_UV: [nh, D, R]

    def forward_absorbed(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, slots: Tensor | None,
        ctx_len: Tensor, visible: Tensor, tree_kv_out: Tensor, prefix: PrefixKernel | None = None,
        bias: Tensor | None = None,
    ) -> Tensor:
        """`x [bs, Q, H]`; writes the queries' own cache rows into `tree_kv_out [bs, Q, R + P]`.
        `bias`: the torch path's key bias, shared by all layers (`ops.attention.joint_bias`)."""
        c = self.cfg
        q, row = self.latents(x, cos, sin)
        tree_kv_out.copy_(row)
        w_uk, w_uv = self._absorb_weights()
        q_lat = torch.einsum("bqhd,hdr->bqhr", q[..., :c.qk_nope_head_dim], w_uk)
        o_lat = absorbed_attention(q_lat, q[..., c.qk_nope_head_dim:], kv_cache, slots, ctx_len,
                                   tree_kv_out, visible, c.kv_lora_rank, self.scale, prefix, bias)
        o = torch.einsum("bqhr,hvr->bqhv", o_lat.to(x.dtype), w_uv)
        return self.o_proj(o.reshape(*x.shape[:-1], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, tp: Group | None = None):
        super().__init__()
        self.index = i
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, tp)
        if cfg.is_moe(i):
            self.mlp: nn.Module = MoE(cfg, i, tp)
        else:
            if tp is not None:
                tp.divide(cfg.intermediate_size, "intermediate_size", cfg.source or "config")
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, fp8=cfg.fp8_block)

    def forward(self, carry: list[Tensor | None], attend: Attend, moe: str
                ) -> tuple[Tensor, Tensor, Tensor, Any]:
        """`carry = [h, delta]`, the residual stream as `h + delta` (`h [..., H]`; `delta` None:
        `h` alone), which the layer empties (so that, with the caller holding no reference,
        both halves are freed once added) -> `(stream, h', delta', extra)`: `stream = h +
        delta`, the layer's input (the previous layer's output), and the layer's output as `h'
        + delta'`, its last branch not yet added. Each residual add runs in the kernel of the
        norm that reads its sum (`RMSNorm.add`), this layer's second one in the next layer's
        first norm. `attend(attn, normed h, layer index)` is the attention form (naive or
        absorbed) and returns `(output, extra)`."""
        stream, x = self.input_layernorm.add(*carry)
        carry.clear()
        a, extra = attend(self.self_attn, x, self.index)
        h, x = self.post_attention_layernorm.add(stream, a)
        return stream, h, (self.mlp(x, moe) if isinstance(self.mlp, MoE) else self.mlp(x)), extra


def run_layers(layers: Sequence[DecoderLayer], h: Tensor, attend: Attend, moe: str,
               aux_layers: Sequence[int], extras: list[Any] | None = None
               ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
    """`layers` over the embeddings `h`: `(h, delta, aux)`, the last layer's output as `h +
    delta` (its last branch not yet added) and the outputs of the layers `aux_layers`, each
    the stream the next layer's first norm formed (no add of its own). `extras` receives each
    layer's `extra`."""
    carry: list[Tensor | None] = [h, None]
    del h
    aux = []
    for i, layer in enumerate(layers):
        stream, h, d, extra = layer(carry, attend, moe)
        if i - 1 in aux_layers:
            aux.append(stream)
        del stream
        carry = [h, d]
        del h, d
        if extras is not None:
            extras.append(extra)
    h, d = carry
    if len(layers) - 1 in aux_layers:
        aux.append(h + d)
    return h, d, aux


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        if tp is not None:
            tp.divide(cfg.vocab_size, "vocab_size", cfg.source or "model config")
        self.model = Backbone(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()
        self.register_buffer("inv_freq", torch.empty(cfg.qk_rope_head_dim // 2),
                             persistent=False)
        self._init_rope()

    def tie_weights(self) -> None:
        """With `tie_word_embeddings`, the lm_head is the embedding (again after `to_empty`,
        which gives every module its own tensors)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_rope(self) -> None:
        c = self.cfg
        inv_freq, self.rope_amplitude = rope_frequencies(
            c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    # ---- checkpoint ------------------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, Stored]:
        """Every tensor this rank loads, by checkpoint name (without the config's prefix)."""
        out = checkpoint_tensors(self)
        if self.cfg.tie_word_embeddings:
            out.pop("lm_head.weight")
        return out

    @classmethod
    def from_dir(cls, path: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, progress: bool = True,
                 tp: Group | None = None) -> KimiForCausalLM:
        """The model of a checkpoint directory; with `tp`, this rank's shard only (each
        tensor's piece is all that is read)."""
        cfg = ModelConfig.from_dir(path)
        with torch.device("meta"):
            model = cls(cfg, tp)
        model.to_empty(device=device)
        model.tie_weights()
        # NOTE: buffers keep their dtypes: the selection-only router bias stays fp32, and
        # quantized weights and their scales stay as stored.
        cast_parameters(model, dtype)
        load_checkpoint(path, model.checkpoint_tensors(), prefix=cfg.weight_prefix,
                        quant=cfg.quantization, progress=progress)
        if torch.device(device).type not in ("cpu", "meta"):
            model.narrow_routers(dtype)
        model._init_rope()
        return model.eval().requires_grad_(False)

    def narrow_routers(self, dtype: torch.dtype, check: bool = True) -> None:
        """Every MoE router narrowed to the 16-bit `dtype` where it holds that dtype's values
        (`Router.narrow_`; without `check`, as a checkpoint storing them so would: the meta
        device's models), so its logits multiply 16-bit inputs into fp32 on the tensor cores;
        where torch's `mm` cannot write fp32 from 16-bit inputs, nothing."""
        if not MM_FP32_OUT:
            return
        for m in self.modules():
            if isinstance(m, Router):
                m.narrow_(dtype, check)

    def param_counts(self) -> tuple[int, int]:
        """`(total, activated)` parameters of the whole model (every rank's pieces), counted at
        their logical shapes whatever their storage: activated counts `num_experts_per_tok`
        routed experts per MoE layer, the rest whole."""
        c = self.cfg
        total = routed = 0
        for name, s in self.checkpoint_tensors().items():
            if name.endswith(("_packed", "_scale", "_scale_inv")):
                continue  # INT4 words and scales, FP8 scales: counted by their logical weight
            n = math.prod(s.value if s.value is not None else s.shape)
            total += n
            routed += n if ".mlp.experts." in name else 0
        return total, total - routed + routed * c.num_experts_per_tok // max(c.n_routed_experts, 1)

    # ---- forwards --------------------------------------------------------------------------------

    def expert_bank(self) -> ExpertBank | None:
        """This rank's first routed expert bank (every MoE layer's has the same shape)."""
        return next((b.mlp.experts for b in self.model.layers if isinstance(b.mlp, MoE)), None)

    def embed(self, ids: Tensor, embeds: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The token embeddings of `ids [B, T]` `[B, T, H]`; with `embeds = (where, rows)`, the
        flat positions `where [K]` (indices into the `B * T` tokens) take `rows [K, H]`
        instead: an image's projected features at its placeholder tokens."""
        h = self.model.embed_tokens(ids)
        if embeds is None:
            return h
        where, rows = embeds
        return h.flatten(0, 1).index_copy(0, where, rows.to(h.dtype)).view_as(h)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.rope_amplitude)

    def forward(
        self, input_ids: Tensor, aux_layers: Sequence[int] = (), moe: str = "dense",
        logits_rows: Tensor | None = None, cache_rows_out: list[Tensor] | None = None,
        attention: MHAPass = TORCH_MHA, kv_cache: Tensor | None = None,
        prefix_slots: Tensor | None = None, logits: str = "all",
        embeds: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Causal forward over `input_ids [B, T]` in the MHA form: at positions `0..T-1`, or
        after a cached prefix of `L` positions: `prefix_slots [B, L]` (the flat slots of
        positions `0..L-1` in `kv_cache [layers, num_slots, R + P]`), the tokens then at
        `L..L+T-1`.

        Returns logits `[B, T, V]` (or only at `logits_rows [B, R]` when given) and the
        concatenated outputs of decoder layers `aux_layers` `[B, T, n * H]` (None if empty).
        When `cache_rows_out` is a list, each layer's latent cache rows `[B, T, R + P]` are
        appended to it (the prefill stores them in the paged cache). `moe`: how the expert
        banks dispatch (`ExpertBank.forward`'s mode), as the caller chose it. `attention`: the
        MHA pass each key set goes through (the attention backend's `prefill_pass`; by default
        the torch twin). `logits`: "all" (as above), "last" (each row's last position's,
        `[B, 1, V]`), "none" (every layer runs, for `cache_rows_out`) or "features" (none, and
        it stops after the last aux layer: the features alone). `embeds`: rows that replace the
        token embeddings (`embed`).
        """
        if logits not in ("all", "last", "none", "features"):
            raise ValueError(f"logits must be all, last, none or features, got {logits!r}")
        B, T = input_ids.shape
        start = 0 if prefix_slots is None else prefix_slots.shape[1]
        pos = (start + torch.arange(T, device=input_ids.device)).expand(B, T)
        cos, sin = self._rope(pos)

        def attend(attn: MLA, x: Tensor, i: int) -> tuple[Tensor, Tensor]:
            prefix = None if start == 0 or kv_cache is None else Prefix(kv_cache[i], prefix_slots)
            return attn.forward_mha(x, cos, sin, attention, prefix)

        last = max(aux_layers) + 1 if logits == "features" else len(self.model.layers)
        h, d, aux = run_layers(self.model.layers[:last], self.embed(input_ids, embeds), attend,
                               moe, aux_layers, cache_rows_out)
        out = None
        if logits in ("all", "last"):
            if logits == "last":
                h, d = h[:, -1:], None if d is None else d[:, -1:]
            elif logits_rows is not None:
                rows_of = logits_rows[..., None].expand(-1, -1, h.shape[-1])
                h, d = h.gather(1, rows_of), None if d is None else d.gather(1, rows_of)
            out = self.lm_head(self.model.norm.add(h, d)[1]).float()
        return out, (torch.cat(aux, dim=-1) if aux else None)

    def verify(
        self, tokens: Tensor, positions: Tensor, kv_cache: Tensor, slots: Tensor | None,
        ctx_len: Tensor, visible: Tensor, tree_kv_out: Tensor, aux_layers: Sequence[int] = (),
        moe: str = "aligned", prefix: PrefixKernel | None = None, logits: str = "all",
        embeds: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Absorbed forward of `Q` query tokens per request against the paged latent cache.

        `tokens, positions [bs, Q]`; `kv_cache [layers, num_slots, R + P]`; `slots [bs, C]` maps
        context position -> cache slot for positions `< ctx_len [bs]` (None where `prefix` reads
        the pages itself); `visible [bs, Q, Q]` says
        which query tokens each query sees (itself included); `tree_kv_out [layers, bs, Q, R + P]`
        receives the queries' own cache rows (the commit copies the accepted ones into the
        cache). Returns logits `[bs, Q, V]` (fp32) and the aux-layer features `[bs, Q, n * H]`.
        `moe`: how the expert banks dispatch (`ExpertBank.forward`'s mode), as the caller chose
        it (by default the fixed-shape pass over aligned blocks, which graphs need). `prefix`:
        the step's prefix-attention kernel (the attention backend's; one serves every layer), or
        None for one softmax over the gathered `slots` and the queries' own rows.
        `logits`: "all" (every query's), "last" (each row's last query's, `[bs, 1, V]`), "none"
        (every layer runs, for `tree_kv_out`), or "features" (none, and it stops after the last
        aux layer: the features alone). `embeds`: rows that replace the token embeddings
        (`embed`).
        """
        if logits not in ("all", "last", "none", "features"):
            raise ValueError(f"logits must be all, last, none or features, got {logits!r}")
        cos, sin = self._rope(positions)
        heads = self.model.layers[0].self_attn.num_heads
        bias = joint_bias(slots, ctx_len, visible, heads) if prefix is None else None

        def attend(attn: MLA, x: Tensor, i: int) -> tuple[Tensor, None]:
            return attn.forward_absorbed(x, cos, sin, kv_cache[i], slots, ctx_len, visible,
                                         tree_kv_out[i], prefix, bias), None

        last = max(aux_layers) + 1 if logits == "features" else len(self.model.layers)
        h, d, aux = run_layers(self.model.layers[:last], self.embed(tokens, embeds), attend, moe,
                               aux_layers)
        if logits == "last":
            h, d = h[:, -1:], None if d is None else d[:, -1:]
        out = (self.lm_head(self.model.norm.add(h, d)[1]).float()
               if logits in ("all", "last") else None)
        return out, (torch.cat(aux, dim=-1) if aux else None)
