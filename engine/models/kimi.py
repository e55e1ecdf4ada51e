"""The target model: Kimi K2 / DeepSeek-V3 (MLA with YaRN, noaux_tc MoE with a shared expert).

Module names mirror the checkpoint's tensor names, so `state_dict()` is a checkpoint and a
checkpoint is a `state_dict()`. Two attention forms:

- `forward` / `prefill`: the naive form (keys and values expanded per head), causal;
- `verify`: the absorbed form over the latent cache (`kv_lora_rank + qk_rope_head_dim` values per
  token per layer), for any number of query tokens with an explicit visibility mask among them:
  decode is one query, the tree verify is `N` queries under the ancestor mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig
from ops.attention import PrefixKernel, absorbed_attention, joint_mask, mla_naive
from ops.moe import dense_is_cheaper, experts_dense, experts_sparse, route_noaux_tc
from ops.rope import apply_rope_interleaved, rope_cos_sin, rope_frequencies

if TYPE_CHECKING:
    from engine.parallel import TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # The same math as below in one op (fewer launches per step).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(hidden, inter), _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        # NOTE: the correction bias only selects experts; it stays fp32 whatever the model dtype.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts))
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts else None)
        self._w13: Tensor | None = None
        self._w2: Tensor | None = None

    def pack(self) -> None:
        """Stack expert weights for batched dispatch (inference). The per-expert parameters
        become views of the stacks, so nothing is stored twice."""
        w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
        w2 = torch.stack([e.down_proj.weight for e in self.experts])
        inter = self.cfg.moe_intermediate_size
        for i, e in enumerate(self.experts):
            e.gate_proj.weight.data = w13[i, :inter]
            e.up_proj.weight.data = w13[i, inter:]
            e.down_proj.weight.data = w2[i]
        self._w13, self._w2 = w13, w2

    def _stacks(self) -> tuple[Tensor, Tensor]:
        if self._w13 is not None:
            return self._w13, self._w2
        # Training: differentiable stacks rebuilt each call.
        w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
        return w13, torch.stack([e.down_proj.weight for e in self.experts])

    def forward(self, x: Tensor, sparse: bool = False, loads: list[Tensor] | None = None
                ) -> Tensor:
        """`loads`, when a list, receives this layer's tokens per expert (training)."""
        c = self.cfg
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        logits = F.linear(x2.float(), self.gate.weight.float())
        idx, w = route_noaux_tc(logits, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                                c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        if loads is not None:
            loads.append(torch.bincount(idx.reshape(-1), minlength=c.n_routed_experts).float())
        w13, w2 = self._stacks()
        y = (experts_sparse if sparse else experts_dense)(x2, idx, w, w13, w2)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.view(shape)


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank:
            self.q_a_proj = _linear(H, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = _linear(cfg.q_lora_rank, nh * cfg.qk_head_dim)
        else:
            self.q_proj = _linear(H, nh * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(H, cfg.kv_cache_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(nh * cfg.v_head_dim, H)
        self.scale = cfg.softmax_scale

    def latents(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`x [..., H]` -> `q [..., nh, qk_head_dim]` (rope part rotated) and the cache row
        `[..., R + P]` (normalized `c_kv`, rotated `k_pe`)."""
        c = self.cfg
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(*x.shape[:-1], c.num_attention_heads, c.qk_head_dim)
        q_pe = apply_rope_interleaved(q[..., c.qk_nope_head_dim:], cos, sin)
        q = torch.cat([q[..., :c.qk_nope_head_dim], q_pe], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        ckv = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        kpe = apply_rope_interleaved(kv[..., None, c.kv_lora_rank:], cos, sin)[..., 0, :]
        return q, torch.cat([ckv, kpe], dim=-1), kv

    def forward_naive(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Causal attention over `x [B, T, H]`; also returns the cache rows `[B, T, R + P]`."""
        c = self.cfg
        q, row, _ = self.latents(x, cos, sin)
        kvb = self.kv_b_proj(row[..., :c.kv_lora_rank])
        kvb = kvb.view(*x.shape[:-1], c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kvb[..., :c.qk_nope_head_dim], kvb[..., c.qk_nope_head_dim:]
        o = mla_naive(q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:], k_nope,
                      row[..., c.kv_lora_rank:], v, self.scale)
        return self.o_proj(o.reshape(*x.shape[:-1], -1)), row

    def _absorb_weights(self) -> tuple[Tensor, Tensor]:
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim,
                                       c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]  # W_UK [nh,Dn,R], W_UV [nh,Dv,R]

    def forward_absorbed(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, slots: Tensor,
        ctx_len: Tensor, visible: Tensor, tree_kv_out: Tensor, prefix: PrefixKernel | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """`x [bs, Q, H]`; writes the queries' own cache rows into `tree_kv_out [bs, Q, R + P]`.
        `mask`: the torch path's key mask, shared by all layers (`ops.attention.joint_mask`)."""
        c = self.cfg
        q, row, _ = self.latents(x, cos, sin)
        tree_kv_out.copy_(row)
        w_uk, w_uv = self._absorb_weights()
        q_lat = torch.einsum("bqhd,hdr->bqhr", q[..., :c.qk_nope_head_dim], w_uk)
        o_lat = absorbed_attention(q_lat, q[..., c.qk_nope_head_dim:], kv_cache, slots, ctx_len,
                                   tree_kv_out, visible, c.kv_lora_rank, self.scale, prefix, mask)
        o = torch.einsum("bqhr,hvr->bqhv", o_lat.to(x.dtype), w_uv)
        return self.o_proj(o.reshape(*x.shape[:-1], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.tp: TensorParallel | None = None  # set by engine.parallel when sharded

    def ffn(self, h: Tensor, sparse: bool, loads: list[Tensor] | None = None) -> Tensor:
        x = self.post_attention_layernorm(h)
        y = self.mlp(x, sparse, loads) if isinstance(self.mlp, MoE) else self.mlp(x)
        if self.tp is not None:
            # NOTE: each rank holds a slice of every expert's (and the dense MLP's) intermediate
            # dim, so its output is a partial sum: one all-reduce for routed + shared experts.
            y = self.tp.all_reduce(y)
        return h + y


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, amp = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                         cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_amplitude = amp

    # ---- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, progress: bool = True,
                 tp: TensorParallel | None = None) -> KimiForCausalLM:
        """With `tp`, this rank's shard only (each tensor's piece is all that is read)."""
        from engine.weights import load_target_weights

        cfg = ModelConfig.from_dir(path)
        shard_fn = tp.target_shard_fn(cls, cfg) if tp is not None else None
        weights = load_target_weights(path, cfg, device=device, dtype=dtype, progress=progress,
                                      shard_fn=shard_fn)
        return cls.from_weights(cfg, weights, device, dtype, tp=tp)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, Tensor],
                     device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32,
                     tp: TensorParallel | None = None) -> KimiForCausalLM:
        with torch.device("meta"):
            model = cls(cfg) if tp is None else tp.build_target(cls, cfg)
        model.to_empty(device=device)
        model.to(dtype)
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                # NOTE: selection-only bias: kept fp32 (load_state_dict copies into its dtype).
                layer.mlp.gate.e_score_correction_bias = torch.empty(
                    cfg.n_routed_experts, dtype=torch.float32, device=device)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        inv_freq, _ = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                       cfg.max_position_embeddings)
        model.inv_freq = inv_freq.to(device)
        return model.finalize()

    def finalize(self) -> KimiForCausalLM:
        """Switch to inference: no grads, experts stacked for dispatch."""
        self.eval().requires_grad_(False)
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.pack()
        return self

    # ---- forwards --------------------------------------------------------------------------------

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.rope_amplitude)

    def forward(
        self, input_ids: Tensor, aux_layers: Sequence[int] = (), sparse_moe: bool = False,
        logits_rows: Tensor | None = None, cache_rows_out: list[Tensor] | None = None,
        expert_loads: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Naive causal forward over `input_ids [B, T]` at positions `0..T-1`, no cache.

        Returns logits `[B, T, V]` (or only at `logits_rows [B, R]` when given) and the
        concatenated outputs of decoder layers `aux_layers` `[B, T, n * H]` (None if empty).
        When `cache_rows_out` is a list, each layer's latent cache rows `[B, T, R + P]` are
        appended to it (the prefill path stores them in the paged cache); `expert_loads` gets
        each MoE layer's tokens per expert.
        """
        B, T = input_ids.shape
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = self._rope(pos)
        h = self.model.embed_tokens(input_ids)
        aux = []
        for i, layer in enumerate(self.model.layers):
            a, rows = layer.self_attn.forward_naive(layer.input_layernorm(h), cos, sin)
            if cache_rows_out is not None:
                cache_rows_out.append(rows)
            h = layer.ffn(h + a, sparse_moe, expert_loads)
            if i in aux_layers:
                aux.append(h)
        if logits_rows is not None:
            h = h.gather(1, logits_rows[..., None].expand(-1, -1, h.shape[-1]))
        logits = self.lm_head(self.model.norm(h)).float()
        return logits, (torch.cat(aux, dim=-1) if aux else None)

    def verify(
        self, tokens: Tensor, positions: Tensor, kv_cache: Tensor, slots: Tensor,
        ctx_len: Tensor, visible: Tensor, tree_kv_out: Tensor, aux_layers: Sequence[int] = (),
        sparse_moe: bool = False, prefix: PrefixKernel | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Absorbed forward of `Q` query tokens per request against the paged latent cache.

        `tokens, positions [bs, Q]`; `kv_cache [layers, num_slots, R + P]`; `slots [bs, C]` maps
        context position -> cache slot for positions `< ctx_len [bs]`; `visible [bs, Q, Q]` says
        which query tokens each query sees (itself included); `tree_kv_out [layers, bs, Q, R + P]`
        receives the queries' own cache rows (the commit copies the accepted ones into the
        cache). Returns logits `[bs, Q, V]` (fp32) and the aux-layer features `[bs, Q, n * H]`.
        `sparse_moe` allows the eager-only expert dispatch (see `ops.moe`), taken unless the
        dense one is cheaper for this many rows; `prefix` a planned prefix-attention kernel (one
        plan serves every layer).
        """
        c = self.cfg
        if sparse_moe and c.n_routed_experts:
            sparse_moe = not dense_is_cheaper(tokens.numel(), c.n_routed_experts, c.hidden_size,
                                              c.moe_intermediate_size)
        cos, sin = self._rope(positions)
        mask = joint_mask(slots, ctx_len, visible) if prefix is None else None
        h = self.model.embed_tokens(tokens)
        aux = []
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn.forward_absorbed(layer.input_layernorm(h), cos, sin, kv_cache[i],
                                                 slots, ctx_len, visible, tree_kv_out[i],
                                                 prefix, mask)
            h = layer.ffn(h + a, sparse_moe)
            if i in aux_layers:
                aux.append(h)
        logits = self.lm_head(self.model.norm(h)).float()
        return logits, (torch.cat(aux, dim=-1) if aux else None)
