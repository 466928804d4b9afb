"""The reference decoder against transformers on every family, and its own invariants."""

from __future__ import annotations

import pytest
import torch

from conftest import ALL_NAMES, assert_close
from hf_models import hf_greedy, load_hf
from tk.models.spec.contract import LayerState, position_ids_from_mask
from tk.models.checkpoint.loading import load_decoder
from tk.runtimes.decoding.generate import generate
from tk.runtimes.backends.torch import TorchRuntime


def _batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (2, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # row 1 is 15 tokens, left-padded
    return ids, mask


@pytest.mark.parametrize("family", ALL_NAMES)
def test_logits_match_transformers(checkpoints, family):
    folder = checkpoints(family)
    hf, ours = load_hf(folder), load_decoder(folder)
    ids, mask = _batch(ours.config.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        logits, present = ours(ids, mask, position_ids_from_mask(mask))
    keep = mask.bool()
    assert expected[keep].std() > 0.3, "logits are flat: the fixture's weights are too narrow to test anything"
    assert_close(logits[keep], expected[keep], 1e-4, family)
    assert len(present) == ours.config.num_layers
    cfg = ours.config
    for i, state in enumerate(present):  # keys and values of the layer's own sizes, a recurrent layer's state, or none
        layer = LayerState.of(cfg, i)  # (a KV-shared layer: Gemma 4's)
        shapes = [(2, *shape) for _, shape in layer.tensors] or [(2, layer.kv_heads, 21, layer.head_dim)] * 2 * layer.kv
        assert [tuple(t.shape) for t in state] == shapes


@pytest.mark.parametrize("family", ALL_NAMES)
def test_greedy_32_tokens_match_transformers_generate(checkpoints, family):
    folder = checkpoints(family)
    hf, ours = load_hf(folder), load_decoder(folder)
    prompt = torch.randint(2, ours.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = hf_greedy(folder, prompt[0].tolist(), 32, hf)
    with TorchRuntime(ours) as rt:
        result = generate(rt, [prompt[0].tolist()], 32, ignore_eos=True)
    assert result.rows[0].tokens == expected
    assert len(set(expected)) > 3, "greedy output is degenerate; the test would not see a divergence"


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma", "mistral", "granite", "olmo2", "smollm3", "lfm2",
                                    "qwen35", "granite_h"])
def test_cache_parity(checkpoints, family):
    """Full forward over N tokens == prefill N-k then k single-token steps through the cache (a hybrid's
    recurrent layers: through their state)."""
    model = load_decoder(checkpoints(family))
    ids, mask = _batch(model.config.vocab_size, seed=5)
    n, k = ids.shape[1], 6
    with torch.no_grad():
        full, _ = model(ids, mask, position_ids_from_mask(mask))
        m = mask[:, : n - k]
        logits, cache = model(ids[:, : n - k], m, position_ids_from_mask(m))
        steps = [logits]
        for t in range(n - k, n):
            m = mask[:, : t + 1]
            logits, cache = model(ids[:, t : t + 1], m, position_ids_from_mask(m)[:, -1:], cache)
            steps.append(logits)
    incremental = torch.cat(steps, dim=1)
    keep = mask.bool()
    # a recurrent layer sums the same terms in another order run whole than token by token (its closed form
    # over a run against k updates): within float32 rounding of logits of magnitude ~6
    atol = 3e-5 if model.config.stateful else 1e-5
    assert_close(incremental[keep], full[keep], atol, family)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_no_causal_leak(checkpoints, family):
    model = load_decoder(checkpoints(family))
    ids = torch.randint(2, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(7))
    changed = ids.clone()
    changed[0, 9:] = torch.randint(2, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a, _ = model(ids, mask, position_ids_from_mask(mask))
        b, _ = model(changed, mask, position_ids_from_mask(mask))
    assert torch.equal(a[0, :9], b[0, :9])
    assert not torch.allclose(a[0, 9:], b[0, 9:])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "smollm3", "lfm2", "qwen35", "granite_h"])
def test_row_alone_equals_row_in_padded_batch(checkpoints, family):
    """Left padding is masked: in attention, and in a recurrent layer, whose state stays zero under it."""
    model = load_decoder(checkpoints(family))
    ids, mask = _batch(model.config.vocab_size, seed=11)
    ids[1, :6] = 5  # content under the padding must not matter
    with torch.no_grad():
        batch, _ = model(ids, mask, position_ids_from_mask(mask))
        alone_ids, alone_mask = ids[1:, 6:], mask[1:, 6:]
        alone, _ = model(alone_ids, alone_mask, position_ids_from_mask(alone_mask))
        ids[1, :6] = 9
        other, _ = model(ids, mask, position_ids_from_mask(mask))
    assert_close(batch[1, 6:], alone[0], 1e-5, family)
    assert torch.equal(batch[1, 6:], other[1, 6:])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_load_tracks_float32(checkpoints, dtype):
    folder = checkpoints("llama")
    ref, half = load_decoder(folder), load_decoder(folder, dtype)
    assert half.embed.weight.dtype == getattr(torch, dtype)
    ids, mask = _batch(ref.config.vocab_size)
    with torch.no_grad():
        a, _ = ref(ids, mask, position_ids_from_mask(mask))
        b, _ = half(ids, mask, position_ids_from_mask(mask))
    assert b.dtype == torch.float32  # logits are float32 in every precision
    keep = mask.bool()
    assert_close(b[keep], a[keep], 0.1 if dtype == "float16" else 0.5, dtype)
    assert (a[keep].argmax(-1) == b[keep].argmax(-1)).float().mean() > 0.8
