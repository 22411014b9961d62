"""The attention mask under context parallelism: a description of it, never the ``[batch, 1, S, S]`` tensor.

While a context-parallel forward runs, the model's config names the Ulysses wrapper, under which this
module's ``describe_mask`` is registered in transformers' mask registry (``compat.transformers``). So
``create_causal_mask`` and its sliding-window and chunked kin, having composed the mask function as
they always do (causal, the window, packed documents from the position ids, a model's own overlay),
hand the model the arguments they would have built the mask from instead of the mask: the function and
the 2D padding. Ring attention builds each chunk pair's mask from them at the pair's size with
transformers' own ``sdpa_mask`` (``MaskDescription.pair``), so a mask costs one pair's ``[batch, 1, c, c]``
at a time, whatever the length.

Ring attention skips the pairs whose keys all come after their queries, and those wholly beyond a sliding
window. A mask function transformers composed from causal parts (and its sliding-window overlay) is known
causal, and its window, from the composition, nothing evaluated; any other (a bidirectional overlay:
image tokens, a prefix) is evaluated over the skipped pairs, one pair at a time, once per call, and
refused by name if it opens one (``skipped_pairs_opened``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compat.transformers import mask_block, mask_reach


@dataclass(frozen=True, eq=False)
class MaskDescription:
    """What ``create_causal_mask`` would have built a ``[batch, 1, tokens, tokens]`` mask from."""

    batch: int
    tokens: int  # queries and keys: the whole (unpadded) sequence, no cache
    mask_function: Callable  # transformers' (batch, head, query, key) -> allowed
    padding: torch.Tensor | None  # [batch, tokens] bool, False at padding keys (None: no padding)
    use_vmap: bool  # as transformers asked for this function (a model's own overlay)
    causal: bool  # no query sees a key after it, by construction
    window: int | None  # by construction no query sees a key this far back or further (None: not known)

    def __getitem__(self, index):  # model code that indexes its mask (an indexer's, a KV-sharing layer's)
        raise TypeError(
            "context parallelism hands the model a description of its attention mask (hf_parallel/sequence/"
            "masks.py), not the [batch, 1, S, S] tensor; this model's code indexes the mask itself, which ring "
            "attention does not serve: use sp_size alone"
        )

    def pair(self, queries: tuple[int, int], keys: tuple[int, int], device) -> torch.Tensor:
        """The ``[batch, 1, queries, keys]`` boolean mask of positions ``range(*queries)`` against
        ``range(*keys)``; query positions past the sequence (the ring's padding) attend to every key."""
        real = (queries[0], min(queries[1], self.tokens))
        if real[1] <= real[0]:
            shape = (self.batch, 1, queries[1] - queries[0], keys[1] - keys[0])
            return torch.ones(shape, dtype=torch.bool, device=device)
        mask = mask_block(self.mask_function, self.padding, self.batch, real, keys, self.use_vmap, device)
        missing = queries[1] - real[1]
        return torch.nn.functional.pad(mask, (0, 0, 0, missing), value=True) if missing else mask


def describe_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> MaskDescription | None:
    """Registered in transformers' mask registry: the mask as a description (None where ``sdpa_mask``
    would return None too: plain causal, no padding, no window reached; ring attention is then causal
    from the chunks' positions). Reading whether a padding mask pads anything (``generate`` passes one of
    ones) is the one host read, as ``sdpa_mask``'s own: a mask of ones is no padding. Traced by
    ``torch.compile`` it is not read: a mask given is kept as padding."""
    if q_offset or kv_offset or q_length != kv_length:
        raise ValueError(
            f"context parallelism: a mask over {q_length} queries and {kv_length} keys (offsets {q_offset}, "
            f"{kv_offset}) follows tokens cached before this forward, which a split forward cannot attend to "
            "(only a decode step, which runs whole, can)"
        )
    reads = attention_mask is not None and not torch.compiler.is_compiling()  # (traced: no host read, kept)
    padding = attention_mask if attention_mask is not None and not (reads and bool(attention_mask.all())) else None
    if allow_is_causal_skip and (local_size is None or kv_length < local_size) and padding is None:
        return None
    return MaskDescription(batch_size, q_length, mask_function, padding, use_vmap, *mask_reach(mask_function))


def skipped_pairs_opened(description: MaskDescription, chunk: int, chunks: int, window: int | None,
                         device) -> str | None:  # fmt: skip
    """What the mask opens among the pairs ring attention skips: keys after their query, or further back
    than ``window`` (None: nothing). Nothing is evaluated where the description knows it by construction
    (transformers' causal compositions, its window no wider than ``window``); else every rank evaluates
    every such pair (so all give the same answer and refuse together), one pair at a time, and the answer
    is one host read."""
    check_after = not description.causal
    check_behind = bool(window) and (description.window is None or description.window > window)
    if not (check_after or check_behind):
        return None
    after = torch.zeros((), dtype=torch.bool, device=device)
    behind = torch.zeros((), dtype=torch.bool, device=device)
    for qi in range(chunks):
        queries = (qi * chunk, min((qi + 1) * chunk, description.tokens))  # (the ring's padding rows attend to all)
        if queries[0] >= queries[1]:
            break
        for ki in range(chunks):
            keys = (ki * chunk, min((ki + 1) * chunk, description.tokens))
            if keys[1] <= keys[0]:
                break
            if ki > qi and check_after:
                after |= description.pair(queries, keys, device).any()
            elif ki <= qi and check_behind and (qi - ki - 1) * chunk + 1 > window:
                behind |= description.pair(queries, keys, device).any()
    return what_opens(after, behind if check_behind else None, window)


def what_opens(after: torch.Tensor, behind: torch.Tensor | None, window: int | None) -> str | None:
    """What the flags ``after`` and ``behind`` (device booleans: the mask lets some query past its causal edge,
    or further back than ``window``) say the mask opens among the skipped pairs (None: nothing): one host read.
    Traced by ``torch.compile``, no host read in the graph: refused on the device instead (``_assert_async``)."""
    found = ((after, OPENS_AFTER), (behind, opens_behind(window) if window else ""))
    if torch.compiler.is_compiling():
        for flag, what in found:
            if flag is not None:
                torch._assert_async(~flag, f"context parallelism: the model's attention mask {what}")
        return None
    return next((what for flag, what in found if flag is not None and bool(flag)), None)


OPENS_AFTER = "lets a query attend to keys after it (bidirectional blocks: image tokens, a prefix)"


def opens_behind(window: int) -> str:
    return f"lets a query attend further back than its sliding window ({window})"
