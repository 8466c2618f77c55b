"""Draft-file source: in-context prompt lookup first, then the DFlash draft file, with confidences.

Prompt lookup wins when the current context repeats itself (an n-gram of >= `prompt_min_ngram`
tokens occurred earlier: copied code, quoted text, repetition loops); otherwise the file's longest
matching order proposes its best continuation, and when that runs out before k tokens the file is
asked again with the drafted tokens appended (a chain walk). When the file knows nothing either,
single-token prompt lookup gets the last word, so the source drafts wherever prompt lookup alone would. Drafts are point masses (probs=None),
which the lossless rejection rule handles at any temperature.

Confidence of draft token j = P(t_j | key, t_<j) from the file's exact prefix counts (how often the
key was followed by t_1..t_j, over how often by t_1..t_j-1): an estimate of P(token j accepted |
tokens < j accepted) under the corpus distribution.

`tree=True` returns the key's continuations merged into a token tree (Draft.parents), each leaf extended by
one more lookup of its own context (all leaves in one `lookup_batch`, the tree's version of the chain walk),
and keeps the k nodes of highest path probability; the default `tree=False` returns the best chain, which the
chain verifier takes.

Registry (one line in inference/sources/__init__.py):
    SOURCES["draft_file"] = "inference.sources.draft_file:draft_file_source"
Spec: "draft_file:PATH" or "draft_file:PATH,tree=1,prompt_min_ngram=2,prompt_lookup=0".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data.draft_file import DraftFile
from inference.sampling import SamplingConfig
from inference.sources.base import Draft, DraftContext
from inference.sources.prompt_lookup import PromptLookup


class DraftFileSource:
    name = "draft_file"
    needs_features = False

    def __init__(self, file: DraftFile | str | Path, target=None, prompt_lookup: bool = True,
                 prompt_max_ngram: int = 3, prompt_min_ngram: int = 2, tree: bool = False):
        self.file = file if isinstance(file, DraftFile) else DraftFile(file)
        if target is not None:
            self.file.check_target(target)
        self.prompt = PromptLookup(max_ngram=prompt_max_ngram, min_ngram=prompt_min_ngram) if prompt_lookup else None
        self.fallback = PromptLookup(max_ngram=prompt_min_ngram - 1, min_ngram=1) \
            if prompt_lookup and prompt_min_ngram > 1 else None
        self.tree = tree
        self.window = max(self.file.orders)
        self.stats = {"prompt": 0, "file": 0, "fallback": 0, "none": 0}  # which part answered each propose()

    def reset(self) -> None:
        if self.prompt is not None:
            self.prompt.reset()

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingConfig) -> Draft:
        if k <= 0:
            return Draft(tokens=torch.empty(0, dtype=torch.long))
        if self.prompt is not None:
            draft = self.prompt.propose(ctx, k, sampling)
            if draft.size:
                self.stats["prompt"] += 1
                return draft
        tail = ctx.tokens[-self.window:].tolist()
        draft = self._tree(tail, k) if self.tree else self._chain(tail, k)
        if draft.size:
            self.stats["file"] += 1
            return draft
        if self.fallback is not None:
            draft = self.fallback.propose(ctx, k, sampling)
        self.stats["fallback" if draft.size else "none"] += 1
        return draft

    def _chain(self, tail: list[int], k: int) -> Draft:
        tokens: list[int] = []
        confidences: list[float] = []
        while len(tokens) < k:
            c = self.file.lookup(tail + tokens)
            if c is None:
                break
            n = min(int(c.lengths[0]), k - len(tokens))
            tokens += c.tokens[0, :n].tolist()
            confidences += c.confidences[0, :n].tolist()
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long),
                     confidences=torch.tensor(confidences, dtype=torch.float32) if tokens else None)

    def _tree(self, tail: list[int], k: int) -> Draft:
        c = self.file.lookup(tail)
        if c is None:
            return Draft(tokens=torch.empty(0, dtype=torch.long))
        # trie of the continuations: node = (parent, token); its confidence is the same from every leaf under it
        index: dict[tuple[int, int], int] = {}
        parent, token, cond = [], [], []

        def add(under: int, rows: list, confs: list) -> None:
            for row, conf in zip(rows, confs):
                node = under
                for t, p in zip(row, conf):
                    if t < 0:
                        break
                    if (node, t) not in index:
                        index[(node, t)] = len(token)
                        parent.append(node), token.append(t), cond.append(p)
                    node = index[(node, t)]

        add(-1, c.tokens.tolist(), c.confidences.tolist())
        # one more hop for every leaf, as the chain walk takes for its one path: all leaves' contexts in one lookup
        leaves = sorted(set(range(len(token))) - set(parent))
        contexts = np.full((len(leaves), self.window), -1, np.int64)
        for r, leaf in enumerate(leaves):
            path, node = [], leaf
            while node >= 0:
                path.append(token[node])
                node = parent[node]
            seq = (tail + path[::-1])[-self.window:]
            contexts[r, self.window - len(seq):] = seq
        more = self.file.lookup_batch(contexts)
        for r in np.flatnonzero(more.order):
            add(leaves[r], more.tokens[r].tolist(), more.confidences[r].tolist())
        path_p = []
        for i in range(len(token)):  # parents come before children in insertion order
            path_p.append(cond[i] * (path_p[parent[i]] if parent[i] >= 0 else 1.0))
        # a child's path probability never exceeds its parent's, so the top-k set is a tree; ties keep insertion order
        keep = sorted(sorted(range(len(token)), key=lambda i: (-path_p[i], i))[:k])
        new_id = {old: j for j, old in enumerate(keep)}
        return Draft(tokens=torch.tensor([token[i] for i in keep], dtype=torch.long),
                     confidences=torch.tensor([cond[i] for i in keep], dtype=torch.float32),
                     parents=torch.tensor([new_id[parent[i]] if parent[i] >= 0 else -1 for i in keep], dtype=torch.long))


def draft_file_source(arg: str | None, target) -> DraftFileSource:
    """Registry factory: 'PATH' or 'PATH,tree=1,prompt_lookup=0,prompt_min_ngram=2,prompt_max_ngram=3'."""
    from inference.sources import parse_kwargs, path_and_options
    from models.errors import DraftheadsError

    path, rest = path_and_options(arg)
    if not path:
        raise DraftheadsError("draft source 'draft_file' needs a file: write draft_file:PATH.dfl "
                              "(build one with `python -m data.draft_file build`)")
    kw = parse_kwargs(rest, f"draft_file:{arg}", {"tree": int, "prompt_lookup": int, "prompt_min_ngram": int,
                                                  "prompt_max_ngram": int})
    return DraftFileSource(path, target=target, **{k: bool(v) if k in ("tree", "prompt_lookup") else v
                                                   for k, v in kw.items()})
