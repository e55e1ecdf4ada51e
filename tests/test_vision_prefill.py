"""Images in the prompt, end to end on `tools.make_tiny --vision`'s checkpoint: the engine's
greedy tokens (plain decoding and tree speculation with a random drafter, whole and chunked
prefills with a chunk boundary inside an image) equal transformers'
`Kimi_K25ForConditionalGeneration` on the same prompt ids, pixel values and grids (fp32).
Under `--tp 2` the CLI's image line equals one process's: `tests/test_parallel.py`."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from engine import LLM, SamplingParams
from engine.generate import main
from engine.media import MediaError
from engine.request import Request, RequestRejected
from tools.make_draft import make_draft
from tools.make_tiny import make_tiny

pytest.importorskip("transformers", minversion="5.25")

NEW = 6
PAGE = 4
REPO = Path(__file__).resolve().parent.parent


def _png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("k25prefill")
    target = make_tiny(root / "target", vision=True, dtype="fp32", seed=3)
    return target, make_draft(target, root / "draft", block_size=4)


@pytest.fixture(scope="module")
def hf(dirs):
    from transformers import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(dirs[0]).eval()


@pytest.fixture(scope="module")
def llms(dirs):
    target, draft = dirs
    kw = dict(progress=False, dtype="fp32", device="cpu", page_size=PAGE, max_batch_size=2,
              compile="off")
    return {"ar": LLM(target, mode="ar", **kw), "tree": LLM(target, draft, mode="tree", **kw)}


def _messages(a: bytes, b: bytes | None = None) -> list[dict]:
    def image(data: bytes) -> dict:
        return {"type": "image_url", "image_url": {"url": _url(data)}}

    parts = [{"type": "text", "text": "look at"}, image(a)]
    if b is not None:
        parts += [{"type": "text", "text": "and"}, image(b)]
    parts.append({"type": "text", "text": "what is it?"})
    return [{"role": "user", "content": parts}]


def _hf_greedy(hf, ids, images) -> list[int]:
    pixels = torch.cat([im.pixel_values for _, im in images])
    grids = torch.tensor([[1, *im.grid] for _, im in images])
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grids,
                          max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _engine(llm, prompt, chunk: int = 2048) -> list[int]:
    llm.scheduler.prefill_chunk = chunk
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True))
    finally:
        llm.scheduler.prefill_chunk = 2048
    return out[0].token_ids


@pytest.mark.parametrize("mode", ["ar", "tree"])
def test_greedy_tokens_match_transformers_with_two_images(llms, hf, mode):
    llm = llms[mode]
    prompt = {"messages": _messages(_png(60, 40, 1), _png(100, 30, 2))}
    ids, images = llm.encode_with_images(prompt)
    pad = llm.models.vision.cfg.placeholder_id
    assert [im.tokens for _, im in images] == [6, 8]
    assert sum(t == pad for t in ids) == 14
    for pos, im in images:
        assert ids[pos:pos + im.tokens] == [pad] * im.tokens
    want = _hf_greedy(hf, ids, images)
    assert _engine(llm, prompt) == want
    # a chunk boundary inside each image (chunks of 5 tokens; the images are 6 and 8 long)
    assert _engine(llm, prompt, chunk=5) == want


def test_the_prefix_cache_keys_image_pages_by_content(llms, hf):
    """The same image hits the pages its placeholders fill; another image behind the same
    tokens hits only the pages before it, and answers as transformers does."""
    llm = llms["ar"]
    llm.reset_prefix_cache()
    a, b = _png(60, 40, 1), _png(60, 40, 9)
    pa, pb = {"messages": _messages(a)}, {"messages": _messages(b)}
    ids, images = llm.encode_with_images(pa)
    start, n = images[0][0], images[0][1].tokens
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    first = llm.generate([pa], params)[0]
    assert first.cached_tokens == 0
    again = llm.generate([pa], params)[0]
    assert again.token_ids == first.token_ids
    assert again.cached_tokens >= (start + n) // PAGE * PAGE > start
    other = llm.generate([pb], params)[0]
    assert other.cached_tokens == start // PAGE * PAGE
    ids_b, images_b = llm.encode_with_images(pb)
    assert ids_b == ids  # the same tokens: only the image tells them apart
    assert other.token_ids == _hf_greedy(hf, ids_b, images_b) != first.token_ids


def test_a_preempted_image_request_resumes_with_its_images(dirs, llms):
    """Two image prompts in a pool that holds one of them at full length: one is preempted,
    resumes (its image rows recomputed from the images, or hit in the cache) and both answer
    as each does alone."""
    target, _ = dirs
    prompts = [{"messages": _messages(_png(60, 40, 1), _png(100, 30, 2))},
               {"messages": _messages(_png(80, 50, 3))}]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [llms["ar"].generate([p], params)[0].token_ids for p in prompts]
    longest = max(len(llms["ar"].encode_with_images(p)[0]) for p in prompts) + 40
    llm = LLM(target, mode="ar", progress=False, dtype="fp32", device="cpu", page_size=PAGE,
              max_batch_size=2, compile="off", kv_pages=1 + -(-longest // PAGE) + 2)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.scheduler.num_preemptions > 0
    assert got == alone


def test_token_prompts_take_images_beside_them(llms):
    llm = llms["ar"]
    a = _png(60, 40, 1)
    want = _engine(llm, {"messages": _messages(a)})
    # vLLM's form: prompt ids with one placeholder per image, and the images beside them
    ids = llm.tokenizer.apply_chat_template(_messages(a))
    assert _engine(llm, {"prompt_token_ids": ids, "multi_modal_data": {"image": a}}) == want
    img = PILImage.open(io.BytesIO(a))
    assert _engine(llm, {"prompt_token_ids": ids, "multi_modal_data": {"image": [img]}}) == want


def test_image_prompts_are_checked(llms, tmp_path):
    llm = llms["ar"]
    ids = llm.tokenizer.apply_chat_template(_messages(_png(8, 8, 0)))
    with pytest.raises(MediaError, match="1 image placeholders for 2 images"):
        llm.encode_with_images({"prompt_token_ids": ids,
                                "multi_modal_data": {"image": [_png(8, 8, 0)] * 2}})
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(MediaError, match=r"messages\[0\]\.content\[0\]: cannot read image file"):
        llm.encode_with_images({"messages": bad})
    f = tmp_path / "a.png"
    f.write_bytes(_png(60, 40, 1))
    ok = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(f)}}]}]
    assert len(llm.encode_with_images({"messages": ok})[1]) == 1
    ids, images = llm.encode_with_images({"messages": ok})
    req = Request(0, ids, SamplingParams(prompt_logprobs=1), images=images)
    with pytest.raises(RequestRejected, match="prompt_logprobs"):
        llm.scheduler.check(req)


@pytest.mark.parametrize("mode", ["ar", "tree"])
def test_engine_generate_reads_image_parts_from_prompt_files(dirs, llms, hf, tmp_path, mode):
    """`engine.generate`'s messages lines with an image as a file path and as a data URL."""
    target, draft = dirs
    img = tmp_path / "a.png"
    img.write_bytes(_png(60, 40, 1))
    lines = [
        [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": str(img)}}],
        [{"type": "image_url", "image_url": {"url": _url(_png(100, 30, 2))}},
         {"type": "text", "text": "what?"}],
    ]
    prompts = [{"messages": [{"role": "user", "content": c}]} for c in lines]
    pf, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    pf.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    assert main(["--model", str(target), "--draft", str(draft), "--prompts", str(pf),
                 "--output", str(out), "--mode", mode, "--max-new-tokens", str(NEW),
                 "--ignore-eos", "--device", "cpu", "--dtype", "fp32"]) == 0
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    for p, tokens in zip(prompts, got):
        ids, images = llms["ar"].encode_with_images(p)
        assert tokens == _hf_greedy(hf, ids, images)
