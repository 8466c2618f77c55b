"""The draft head families: one registry entry each, with what the rest of the toolkit may assume of them.

A family is a head class (a models.layers.TrainableHead, the interface below) plus a `Family` entry: how to build a
fresh head for a target, the draft.extra options it takes, and the capabilities the trainer, the draft sources, the
plan and the exporters read instead of testing family names. Adding a family = one module with its head class and
one `register(Family(...))` line (tests/test_families.py adds a toy one that trains, saves, loads and drafts).

What callers use of a head (the DraftHead interface):
  family_name, k, config (constructor sizes, saved in config.json), feature ("aux_hidden" | "final_hidden")
  head(batch, plan[, objective]) -> train_forward's DraftTrainOutput rows (or objective(head, rows))
  logits_for(hidden, depth) -> [N, V_draft];  draft_ids -> [V_draft] target ids or None;  full_vocab_logits(logits)
  draft_logits(tokens, features, cache, k, sample_fn) -> [k, V_draft]  (a DraftCache; sample_fn feeds chains)
  attach_target(target, draft_vocab=None, fresh=False) -> the head, sharing the target's frozen modules
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from models.errors import DraftheadsError


@dataclass(frozen=True)
class Family:
    name: str
    head: type  # the head class: head(**sizes recorded in config.json)
    build: Callable  # (target, k, num_layers, draft_vocab, parallel, share_lm_head, **options) -> a fresh head
    options: tuple[str, ...] = ()  # the draft.extra keys it takes
    blocks: bool = False  # trains on whole blocks at random anchors (DSpark, DFlash) instead of COD-sampled depths
    tree: bool = False  # drafts its positions independently: one forward ranks a token tree
    hidden_state: bool = False  # its rows are its own LM-head input: hidden-state regression applies
    confidences: bool = False  # head.draft(...) also returns per-token survival confidences
    exports: tuple[str, ...] = ()  # the serving layouts models.export writes for it


FAMILIES: dict[str, Family] = {}


def register(entry: Family) -> Family:
    FAMILIES[entry.name] = entry
    return entry


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise DraftheadsError(f"draft family '{name}' is unknown; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def _peagle(parallel_family: bool):
    def build(target, k, num_layers, draft_vocab, parallel, share_lm_head, **options):
        from models.peagle import peagle_for_target

        return peagle_for_target(target, k, num_layers, parallel=parallel and parallel_family,
                                 draft_vocab=draft_vocab, **options)
    return build


def _dspark(sequential_default: str):
    def build(target, k, num_layers, draft_vocab, parallel, share_lm_head, sequential=sequential_default, rank=256):
        from models.dspark import dspark_for_target

        if (sequential == "none") != (sequential_default == "none"):
            raise DraftheadsError("draft.family=dspark needs draft.extra.sequential markov or rnn; for the backbone "
                                  "alone use draft.family=dflash")
        return dspark_for_target(target, k, num_layers, draft_vocab, sequential=sequential, rank=rank)
    return build


def _medusa(target, k, num_layers, draft_vocab, parallel, share_lm_head):
    from models.medusa import medusa_for_target

    return medusa_for_target(target, k, num_layers, share_lm_head, draft_vocab)


def _builtin() -> None:
    from models.dspark import DSparkDrafter
    from models.medusa import MedusaHeads
    from models.peagle import PEagleDrafter

    register(Family("peagle", PEagleDrafter, _peagle(True), ("norm_before_residual",), tree=True, hidden_state=True,
                    exports=("speculators",)))
    register(Family("eagle3", PEagleDrafter, _peagle(False), ("norm_before_residual",), hidden_state=True,
                    exports=("speculators", "sglang")))
    register(Family("medusa", MedusaHeads, _medusa, tree=True))
    register(Family("dspark", DSparkDrafter, _dspark("markov"), ("sequential", "rank"), blocks=True,
                    confidences=True))
    register(Family("dflash", DSparkDrafter, _dspark("none"), ("rank",), blocks=True, confidences=True))


_builtin()
