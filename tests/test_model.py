"""The Kimi target against transformers' DeepseekV3ForCausalLM, and its two attention forms
against each other."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVPool
from engine.models.kimi import KimiForCausalLM
from engine.spec import slot_of
from tests.hf_models import CONFIGS, make_hf_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(d, request.param)
    return hf, KimiForCausalLM.from_dir(d, progress=False), d


@pytest.mark.parametrize("T", [1, 7, 45])
def test_logits_match_transformers(pair, T):
    hf, ours, _ = pair
    ids = torch.randint(0, hf.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        ref = hf(ids).logits
    got, _ = ours(ids)
    assert (ref - got).abs().max().item() < 1e-4
    got_sparse, _ = ours(ids, moe="sparse")
    assert (ref - got_sparse).abs().max().item() < 1e-4


def _pool(model: KimiForCausalLM, pages: int = 16, page_size: int = 4) -> KVPool:
    c = model.cfg
    return KVPool.allocate(page_size=page_size, num_pages=pages, target_layers=c.num_hidden_layers,
                           target_dim=c.kv_cache_dim)


def test_prefill_then_absorbed_decode_matches_naive(pair):
    """Prefill P tokens naively into scattered pages, then score the next Q tokens with the
    absorbed form (prefix pass + causal tree pass): equal to one naive forward of P + Q."""
    _, model, _ = pair
    g = torch.Generator().manual_seed(1)
    P, Q = 13, 6
    ids = torch.randint(0, model.cfg.vocab_size, (1, P + Q), generator=g)
    pool = _pool(model)
    pages = torch.tensor([[7, 3, 11, 5, 9, 2]])  # deliberately out of order
    rows: list[torch.Tensor] = []
    with torch.no_grad():
        full, _ = model(ids)
        model(ids[:, :P], cache_rows_out=rows)
        slots = slot_of(pages, torch.arange(P)[None], pool.page_size)[0]
        pool.target[:, slots] = torch.stack([r[0] for r in rows])
        ctx_slots = slot_of(pages, torch.arange(pages.shape[1] * 4)[None], pool.page_size)
        tree_kv = torch.zeros(model.cfg.num_hidden_layers, 1, Q, model.cfg.kv_cache_dim)
        causal = torch.ones(Q, Q, dtype=torch.bool).tril()[None]
        logits, _ = model.verify(ids[:, P:], torch.arange(P, P + Q)[None], pool.target, ctx_slots,
                                 torch.tensor([P]), causal, tree_kv)
    assert (logits - full[:, P:]).abs().max().item() < 1e-4
    # the queries' own latent rows equal what a prefill of the same tokens writes
    rows2: list[torch.Tensor] = []
    with torch.no_grad():
        model(ids, cache_rows_out=rows2)
    assert (tree_kv[:, 0] - torch.stack([r[0, P:] for r in rows2])).abs().max().item() < 1e-5


def test_greedy_ar_equals_transformers_generate(pair, tmp_path):
    from engine import LLM, SamplingParams

    hf, _, d = pair
    prompts = [[5, 9, 2, 44], list(range(30, 61)), [3]]
    llm = LLM(d, mode="ar", max_batch_size=4, progress=False)
    outs = llm.generate([list(p) for p in prompts],
                        SamplingParams(max_new_tokens=64, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=64,
                              min_new_tokens=64, eos_token_id=None, pad_token_id=0)
        assert o.token_ids == ref[0, len(p):].tolist()


def test_make_tiny_loads_in_transformers_with_same_logits(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    from tools.make_tiny import make_tiny

    d = make_tiny(tmp_path / "t", dtype="fp32", layers=3, n_group=2, topk_group=1, shards=2)
    hf = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = KimiForCausalLM.from_dir(d, progress=False)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ref - ours(ids)[0]).abs().max().item() < 1e-4


def test_int4_experts_model_matches_dequantized_model(tmp_path):
    import json

    from engine.config import ModelConfig
    from ops.quant import dequant_int4
    from tools.make_tiny import make_tiny, save_checkpoint

    q = make_tiny(tmp_path / "q", dtype="fp32", int4_experts=True)
    cfg = ModelConfig.from_dir(q)
    assert cfg.quantization is not None and cfg.quantization.method == "int4"
    # dequantize the stored packs independently of the loader, into a plain checkpoint
    from safetensors.torch import load_file

    raw = load_file(str(q / "model.safetensors"))
    plain = {}
    for k, v in raw.items():
        if k.endswith(".weight_packed"):
            base = k.removesuffix(".weight_packed")
            plain[base + ".weight"] = dequant_int4(v, raw[base + ".weight_scale"],
                                                   raw[base + ".weight_shape"])
        elif not k.endswith((".weight_scale", ".weight_shape")):
            plain[k] = v
    conf = json.loads((q / "config.json").read_text())
    conf.pop("quantization_config")
    save_checkpoint(plain, conf, tmp_path / "p", dtype=torch.float32)
    a = KimiForCausalLM.from_dir(q, progress=False)
    b = KimiForCausalLM.from_dir(tmp_path / "p", progress=False)
    ids = torch.randint(0, cfg.vocab_size, (1, 19), generator=torch.Generator().manual_seed(1))
    assert torch.equal(a(ids)[0], b(ids)[0])
    # the quantized model holds exactly what the checkpoint stores, as stored
    assert a.checkpoint_tensors().keys() == raw.keys()
    bank = a.model.layers[1].mlp.experts
    assert bank.fmt == "int4" and bank.w13_packed.dtype == torch.int32
    assert bank.w13_scale.dtype == torch.bfloat16 and not hasattr(bank, "w13")


def test_joint_attention_equals_prefix_tree_merge():
    """The one-softmax torch path equals the split prefix + tree + log-sum-exp merge form that a
    planned prefix kernel uses, rows with an empty context included."""
    from ops.attention import (
        joint_attention,
        joint_bias,
        merge_states,
        prefix_attention,
        tree_attention,
    )

    g = torch.Generator().manual_seed(0)
    bs, Q, H, R, P, C = 3, 5, 4, 16, 8, 24
    q_lat, q_pe = torch.randn(bs, Q, H, R, generator=g), torch.randn(bs, Q, H, P, generator=g)
    kv_cache = torch.randn(bs * C, R + P, generator=g)
    slots = torch.randperm(bs * C, generator=g).view(bs, C)
    ctx_len = torch.tensor([0, 7, C])
    tree_kv = torch.randn(bs, Q, R + P, generator=g)
    parent = torch.tensor([-1, 0, 0, 1, 3])
    visible = torch.eye(Q, dtype=torch.bool)
    for i in range(1, Q):
        visible[i] |= visible[parent[i]]
    visible = visible.expand(bs, Q, Q)
    o1, l1 = prefix_attention(q_lat, q_pe, kv_cache, slots, ctx_len, R, 0.3)
    o2, l2 = tree_attention(q_lat, q_pe, tree_kv, visible, R, 0.3)
    bias = joint_bias(slots, ctx_len, visible, H)
    got = joint_attention(q_lat, q_pe, kv_cache, slots, tree_kv, bias, R, 0.3)
    torch.testing.assert_close(got, merge_states(o1, l1, o2, l2), rtol=1e-5, atol=1e-5)
    # The bias adds exactly 0 to a seen key's score: the same bits as a boolean mask's fill.
    kv = torch.cat([kv_cache[slots], tree_kv], dim=1)
    s = torch.bmm(torch.cat([q_lat, q_pe], -1).reshape(bs, Q * H, -1) * 0.3, kv.transpose(1, 2))
    seen = (bias == 0).view(bs, Q, H, -1)
    assert torch.equal(seen[:, :, 0, C:], visible) and bool((seen == seen[..., :1, :]).all())
    p = torch.softmax(s.view(bs, Q, H, -1).masked_fill(~seen, float("-inf")), -1)
    assert torch.equal(got, torch.bmm(p.view(bs, Q * H, -1), kv[..., :R]).view(bs, Q, H, R))


def test_dense_expert_pass_equals_sparse_dispatch_and_is_taken_only_when_small():
    from engine.cpu import dense_is_cheaper
    from ops.moe import experts_dense, experts_sparse, route_noaux_tc

    g = torch.Generator().manual_seed(0)
    E, H, inter, T = 8, 32, 16, 9
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.1
    w2 = torch.randn(E, H, inter, generator=g) * 0.1
    idx, w = route_noaux_tc(torch.randn(T, E, generator=g), torch.zeros(E), 2, 1, 1, True, 2.5)
    torch.testing.assert_close(experts_dense(x, idx, w, w13, w2),
                               experts_sparse(x, idx, w, w13, w2))
    assert dense_is_cheaper(8, 8, 128, 64)  # the bundled model's experts, 8 plain rows
    assert not dense_is_cheaper(17, 8, 128, 64)  # ... a tree-16 verify: the grouped pass
    # compiled steps: instead of the aligned pass up to 16 rows at budget 32 (528 tokens)
    assert dense_is_cheaper(528, 8, 128, 64, "aligned")
    assert not dense_is_cheaper(48, 8, 128, 64, "sparse")
    assert not dense_is_cheaper(256, 8, 128, 64)  # a 256-token prefill
    for instead_of in ("sparse", "aligned"):  # Kimi K2's experts, one token
        assert not dense_is_cheaper(1, 384, 7168, 2048, instead_of)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexed_expert_pass_equals_dense(dtype):
    """The compiled CPU step's expert pass: each token through its chosen experts only, the
    weights indexed in place, is the dense pass's sum, eagerly and as inductor compiles it."""
    from ops.moe import experts_dense, experts_indexed, route_noaux_tc

    g = torch.Generator().manual_seed(1)
    E, H, inter, T = 8, 32, 16, 9
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.1).to(dtype)
    idx, w = route_noaux_tc(torch.randn(T, E, generator=g), torch.zeros(E), 2, 1, 1, True, 2.5)
    want = experts_dense(x.float(), idx, w, w13.float(), w2.float())
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    got = experts_indexed(x, idx, w, w13, w2)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **tol)
    compiled = torch.compile(experts_indexed, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, idx, w, w13, w2).float(), want, **tol)


def test_the_cpu_expert_passes(pair, tmp_path, monkeypatch):
    """The CPU's expert pass for a forward of n tokens (`engine.cpu`): eagerly, each token
    through its chosen experts (every expert where that costs less), never the indexed pass;
    compiled, a float bank's chosen experts read in place up to INDEXED_MAX_PAIRS pairs, then
    the aligned pass or every expert; a quantized bank never reads in place (it would
    dequantize every pair's expert)."""
    from engine.cpu import INDEXED_MAX_PAIRS, CompiledCPUSteps, eager_expert_pass
    from engine.spec import Models

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    _, model, _ = pair
    k = model.cfg.num_experts_per_tok
    eager = eager_expert_pass(model)
    assert eager(1) == "dense" and eager(300) == "sparse"
    assert "indexed" not in {eager(n) for n in (1, 5, 300, 5000)}
    compiled = CompiledCPUSteps(Models(model), None, threads=2)
    assert compiled.expert_pass(5) == "indexed"
    assert compiled.expert_pass(INDEXED_MAX_PAIRS // k) == "indexed"
    assert compiled.expert_pass(INDEXED_MAX_PAIRS // k + 1) in ("dense", "aligned")
    monkeypatch.setattr(model.expert_bank(), "fmt", "int4")
    assert CompiledCPUSteps(Models(model), None, threads=2).expert_pass(5) == "aligned"
    assert eager_expert_pass(model)(1) == "sparse"


def test_gemm_layout_keeps_the_values_and_every_forward(pair):
    """The eager CPU step's weight layout (`gemm_layout`): float linears and the expert bank
    stored column-major, a tied embedding left as it is, every forward as before."""
    from torch import nn

    from engine.cpu import gemm_layout
    from engine.models.layers import ExpertBank

    _, model, d = pair
    cm = KimiForCausalLM.from_dir(d, progress=False)
    emb = cm.model.embed_tokens.weight
    cm.lm_head.weight = emb  # tied, as with tie_word_embeddings: the lookup keeps its rows
    gemm_layout(cm)
    assert emb.stride() == (emb.shape[1], 1)
    linears = [m for m in cm.modules() if isinstance(m, nn.Linear) and m is not cm.lm_head]
    assert linears and all(m.weight.stride(0) == 1 for m in linears)
    banks = [m for m in cm.modules() if isinstance(m, ExpertBank)]
    for b in banks:
        E, I2, H = b.w13.shape
        assert b.w13.reshape(E * I2, H).stride() == (1, E * I2)  # still a view of one matrix
        assert b.w2.stride()[1] == 1
    cm.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    gemm_layout(cm)
    for (name, a), b in zip(model.state_dict().items(), cm.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for moe in ("dense", "sparse"):
            torch.testing.assert_close(cm(ids, moe=moe)[0], model(ids, moe=moe)[0],
                                       rtol=1e-5, atol=1e-5)


def test_eager_steps_load_the_gemm_layout_and_compiled_ones_the_stored():
    """`load_models`, which the engine and `graphs.profile` share, stores the weights
    column-major for an eager CPU step and leaves them as stored for a compiled one."""
    from engine.config import EngineConfig
    from engine.llm import load_models

    for compile in ("off", "on"):
        models, _ = load_models(EngineConfig(compile=compile), torch.device("cpu"),
                                torch.float32, progress=False)
        for w in (models.target.lm_head.weight, models.drafter.fc.weight):
            if compile == "off":
                assert w.stride(0) == 1 and not w.is_contiguous()
            else:
                assert w.is_contiguous()
