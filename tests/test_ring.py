"""Ring attention's autograd function against softmax attention written out (pure: a ring of one rank
holding two zigzag chunks, so no process group): outputs and every gradient, with soft-capping and
attention sinks, eager's additive mask and sdpa's boolean one, queries masked from every key included."""

from types import SimpleNamespace

import pytest
import torch

from transformers import masking_utils

from hf_parallel.compat.transformers import mask_reach
from hf_parallel.sequence.masks import MaskDescription, describe_mask
from hf_parallel.sequence.ring import MASKED, RingPlan, _RingAttention, _checked_mask
from hf_parallel.sequence.tokens import TokenLayout

B, H, HK, D, C, SCALE = 2, 4, 2, 8, 5, 0.3
CHUNKS = (0, 3)  # the two zigzag chunks ring rank 0 of 2 holds


def written_out(q, k, v, sinks, mask, softcap, tokens):
    """Softmax attention of this rank's queries over its own keys, one pair of chunks at a time as the
    ring computes them, concatenated and normalised once (no log-sum-exp)."""
    k, v = k.repeat_interleave(H // HK, 1), v.repeat_interleave(H // HK, 1)
    outs = []
    for a, qi in enumerate(CHUNKS):
        scores, values = [], []
        for b, ki in enumerate(CHUNKS):
            keys = min(max(tokens - ki * C, 0), C)
            if not keys or (ki > qi and not (mask is not None and mask.dtype != torch.bool)):
                continue
            s = q[:, :, a * C : (a + 1) * C] @ k[:, :, b * C : b * C + keys].transpose(-1, -2) * SCALE
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            m = None if mask is None else mask[..., qi * C : (qi + 1) * C, ki * C : ki * C + keys]
            if m is None and qi == ki:
                m = torch.ones(C, C, dtype=torch.bool).tril()[:, :keys]
            if m is not None:
                s = s.masked_fill(~m, MASKED) if m.dtype == torch.bool else s + m
            scores.append(s)
            values.append(v[:, :, b * C : b * C + keys])
        s, values = torch.cat(scores, -1), torch.cat(values, 2)
        if sinks is not None:
            s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(B, -1, C, 1)], -1)
        p = torch.softmax(s, -1)
        out = p[..., : values.shape[2]] @ values
        if mask is not None and mask.dtype == torch.bool:  # sdpa: a query masked from every key gets zeros
            allowed = torch.cat([mask[..., qi * C : (qi + 1) * C, ki * C : ki * C + C] for ki in CHUNKS], -1)
            out = out * allowed[..., :tokens].any(-1, keepdim=True)
        outs.append(out)
    return torch.cat(outs, 2)


def left_padded(additive: bool):
    """Row 0: keys 0-2 masked, and queries 0-2 masked from every key (left padding); causal."""
    allowed = torch.ones(B, 1, 4 * C, 4 * C, dtype=torch.bool).tril()
    allowed[0, :, :, :3] = False
    if not additive:
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, MASKED)


def described_left_padding() -> MaskDescription:
    """``left_padded``'s mask as transformers' mask creation hands it over under context parallelism."""
    padding = torch.ones(B, 4 * C, dtype=torch.bool)
    padding[0, :3] = False
    described = describe_mask(B, 4 * C, 4 * C, mask_function=masking_utils.causal_mask_function, attention_mask=padding)
    assert isinstance(described, MaskDescription) and described.causal and described.window is None
    return described


@pytest.fixture
def small_tiles(monkeypatch):
    """Written-out pairs scored two queries at a time (a chunk of 5: tiles of 2, 2 and 1)."""
    from hf_parallel.sequence import ring

    monkeypatch.setattr(ring, "SCORE_TILE", 2)


@pytest.mark.parametrize(
    "mask, softcap, sinks, tokens",
    [
        (None, None, False, 20),  # sdpa's causal fast path: no mask, the diagonal pair causal (the fused CPU kernel)
        (None, None, True, 18),  # the fused kernel with sinks and padding keys at the end
        (None, 2.0, True, 18),  # Gemma's soft-capping, gpt-oss's sinks, padding keys at the end
        ("additive", 2.0, False, 5),  # eager: masked queries weigh every key alike
        ("boolean", None, True, 20),  # sdpa: masked queries get zeros
        ("described", None, False, 20),  # sdpa's mask as transformers describes it (masks.py): each pair built
        ("described eager", 2.0, False, 5),  # eager's, described: masked queries weigh every key alike
    ],
)
def test_ring_attention_matches_softmax_written_out(mask, softcap, sinks, tokens, small_tiles):
    torch.manual_seed(0)
    described = mask is not None and mask.startswith("described")
    eager = mask in ("additive", "described eager")
    mask = None if mask is None else left_padded(eager)
    q = torch.randn(B, H, 2 * C, D, requires_grad=True)
    k, v = (torch.randn(B, HK, 2 * C, D, requires_grad=True) for _ in range(2))
    s = torch.randn(H, requires_grad=True) if sinks else None
    layout = TokenLayout(tokens=tokens, sizes=(2 * C,), cp=2, chunk=C)
    ring = SimpleNamespace(rank=0, size=1, group=None)
    held = described_left_padding() if described else mask
    plan = RingPlan(layout, ring, held, SCALE, softcap, None, H // HK, eager=eager)
    inputs = [q, k, v] + ([s] if sinks else [])
    got = _RingAttention.apply(q, k, v, s, plan)
    want = written_out(q, k, v, s, mask, softcap, tokens)
    grad = torch.randn_like(got)
    for name, a, b in zip(("q", "k", "v", "sinks"), torch.autograd.grad(got, inputs, grad),
                          torch.autograd.grad(want, inputs, grad)):  # fmt: skip
        assert torch.allclose(a, b, atol=2e-6, rtol=1e-5), f"d{name} differs by {(a - b).abs().max():.3g}"
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), f"output differs by {(got - want).abs().max():.3g}"


@pytest.mark.parametrize(
    "opened, window, complaint",
    [
        ((2, 5), None, "lets a query attend to keys after it"),  # query 2 sees key 5: a bidirectional block
        ((9, 2), 4, "further back than its sliding window (4)"),  # query 9 sees key 2, 7 back, past a window of 4
    ],
)
def test_a_mask_that_opens_a_skipped_pair_is_refused(opened, window, complaint):
    """Ring attention skips pairs on causality and the window: a model's mask that allows anything there
    (checked once per call) is refused by name instead of silently losing those keys."""
    from hf_parallel.sequence.ring import _checked_mask

    allowed = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    if window:
        allowed &= ~torch.ones(12, 12, dtype=torch.bool).tril(-window)
    sequence = SimpleNamespace(split=SimpleNamespace(cp=SimpleNamespace(size=2)), checked_masks={})
    assert _checked_mask(allowed, sequence, window) is allowed  # the model's own mask: served
    allowed = allowed.clone()
    allowed[..., opened[0], opened[1]] = True
    with pytest.raises(ValueError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        _checked_mask(allowed, SimpleNamespace(split=sequence.split, checked_masks={}), window)


def test_mask_reach_is_read_from_transformers_compositions():
    """Causality and the window of a mask function, read from how transformers composed it (nothing
    evaluated): what lets ring attention skip pairs without checking them."""
    positions = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    documents = masking_utils.find_packed_sequence_indices(positions)
    packed = masking_utils.packed_sequence_compatibility_function(
        masking_utils.sliding_window_causal_mask_function(4), positions, documents
    )
    image = masking_utils.or_masks(masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)
    assert mask_reach(masking_utils.causal_mask_function) == (True, None)
    assert mask_reach(masking_utils.sliding_window_causal_mask_function(4)) == (True, 4)
    assert mask_reach(packed) == (True, 4)
    assert mask_reach(image) == (False, None)
    assert mask_reach(masking_utils.and_masks(image, masking_utils.causal_mask_function)) == (True, None)
    assert mask_reach(lambda b, h, q, k: k <= q) == (False, None)  # a function of its own: evaluated instead


@pytest.mark.parametrize(
    "mask_function, window, complaint, tokens",
    [
        (masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, k: (q == 2) & (k == 5)), None,
         "lets a query attend to keys after it", 12),  # a bidirectional block in a skipped pair
        (masking_utils.causal_mask_function, 4, "further back than its sliding window (4)", 12),  # the layer's window
        (masking_utils.sliding_window_causal_mask_function(4), 4, None, 12),  # its own window: nothing evaluated
        (lambda b, h, q, k: k <= q, None, None, 12),  # a causal function of its own: evaluated, served
        (lambda b, h, q, k: k <= q, 4, "further back than its sliding window (4)", 11),  # the ring's padding row:
        (lambda b, h, q, k: (k <= q) & (q - k < 4), 4, None, 11),  # not a query, so it opens nothing
    ],
)  # fmt: skip
def test_a_described_mask_that_opens_a_skipped_pair_is_refused(mask_function, window, complaint, tokens):
    """A described mask (``masks.py``) is checked pair by pair, once per call, where its construction does
    not say it opens nothing: a bidirectional overlay, or no window where the layer skips pairs by one; the
    ring's padding past the sequence is no query of the mask's."""
    described = describe_mask(1, tokens, tokens, mask_function=mask_function, allow_is_causal_skip=False)
    layout = TokenLayout(tokens=tokens, sizes=(6, 6), cp=2, chunk=3)
    split = SimpleNamespace(cp=SimpleNamespace(size=2), device=torch.device("cpu"))
    sequence = SimpleNamespace(split=split, checked_masks={}, layout=layout)
    if complaint is None:
        assert _checked_mask(described, sequence, window) is described
        return
    with pytest.raises(ValueError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        _checked_mask(described, sequence, window)
