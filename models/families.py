"""The draft head families: one registry entry each, with what the rest of the toolkit may assume of them.

A family is a head class (a models.layers.TrainableHead, the interface below) plus a `Family` entry: how to build a
fresh head for a target, the typed options it takes (a frozen dataclass: `draft.extra` is parsed into it, so a typo,
a wrong type or a value outside its choices fails at compose time), and the capabilities the trainer, the draft
sources, the plan and the exporters read instead of testing family names. Adding a family = one module with its head
class and one `register(Family(...))` line (tests/test_families.py adds a toy one that trains, saves, loads, drafts).

What callers use of a head (the DraftHead interface):
  family_name, k, config (constructor sizes, saved in config.json), feature ("aux_hidden" | "final_hidden")
  head(batch, plan[, objective]) -> train_forward's DraftTrainOutput rows (or objective(head, rows))
  logits_for(hidden, depth) -> [N, V_draft];  draft_ids -> [V_draft] target ids or None;  full_vocab_logits(logits)
  draft_logits(tokens, features, cache, k, sample_fn) -> [k, V_draft]  (a DraftCache; sample_fn feeds chains)
  attach_target(target, draft_vocab=None, fresh=False) -> the head, sharing the target's frozen modules
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Literal, Mapping, get_args, get_origin, get_type_hints

from models.errors import DraftheadsError


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class PEagleOptions:
    norm_before_residual: bool = False  # RMSNorm the fused input before the first residual (speculators' flag)


@dataclass(frozen=True)
class DSparkOptions:
    sequential: Literal["markov", "gated", "rnn"] = "markov"  # the bias over the block (gated: by h_k; rnn: GRU state)
    rank: int = 256  # r of its low-rank transition W1 [V_draft, r], W2 [r, V_draft]
    confidence_grad: bool = False  # the confidence BCE trains the backbone and W1 too (the paper's end-to-end head)

    def __post_init__(self):
        if self.rank < 1:
            raise DraftheadsError(f"draft.extra.rank={self.rank} must be >= 1")


@dataclass(frozen=True)
class Family:
    name: str
    head: type  # the head class: head(**sizes recorded in config.json)
    build: Callable  # (target, k, num_layers, draft_vocab, parallel, share_lm_head, **options) -> a fresh head
    options: type = NoOptions  # a frozen dataclass: the draft.extra keys it takes, typed, with defaults
    blocks: bool = False  # trains on whole blocks at random anchors (DSpark, DFlash) instead of COD-sampled depths
    tree: bool = False  # drafts its positions independently: one forward ranks a token tree
    hidden_state: bool = False  # its rows are its own LM-head input: hidden-state regression applies
    confidences: bool = False  # head.draft(...) also returns per-token survival confidences
    exports: tuple[str, ...] = ()  # the serving layouts models.export writes for it


def family_options(name: str, extra: Mapping | None):
    """draft.extra -> the family's options dataclass; an unknown key, a wrong type or a value outside a Literal's
    choices is a DraftheadsError naming it and what the family takes."""
    kind = family(name).options
    hints = get_type_hints(kind)
    takes = ", ".join(f"{f.name}: {_type_name(hints[f.name])} = {f.default!r}" for f in fields(kind)) or "none"
    values = dict(extra or {})
    for key, value in values.items():
        if key not in hints:
            raise DraftheadsError(f"draft.extra.{key} is not an option of draft.family={name}; it takes {takes}")
        expected = hints[key]
        choices = get_args(expected) if get_origin(expected) is Literal else None
        ok = value in choices if choices else isinstance(value, expected) and not (
            expected is int and isinstance(value, bool))
        if not ok:
            raise DraftheadsError(f"draft.extra.{key}={value!r} is not a {_type_name(expected)}; draft.family={name} "
                                  f"takes {takes}")
    return kind(**values)


def _type_name(kind) -> str:
    return " | ".join(map(repr, get_args(kind))) if get_origin(kind) is Literal else kind.__name__


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


def _dspark(target, k, num_layers, draft_vocab, parallel, share_lm_head, sequential="none", rank=0,
            confidence_grad=False):
    from models.dspark import dspark_for_target

    return dspark_for_target(target, k, num_layers, draft_vocab, sequential=sequential, rank=rank,
                             confidence_grad=confidence_grad)


def _medusa(target, k, num_layers, draft_vocab, parallel, share_lm_head):
    from models.medusa import medusa_for_target

    return medusa_for_target(target, k, num_layers, share_lm_head, draft_vocab)


def _builtin() -> None:
    from models.dspark import DSparkDrafter
    from models.medusa import MedusaHeads
    from models.peagle import PEagleDrafter

    register(Family("peagle", PEagleDrafter, _peagle(True), PEagleOptions, tree=True, hidden_state=True,
                    exports=("speculators",)))
    register(Family("eagle3", PEagleDrafter, _peagle(False), PEagleOptions, hidden_state=True,
                    exports=("speculators", "sglang")))
    register(Family("medusa", MedusaHeads, _medusa, tree=True))
    register(Family("dspark", DSparkDrafter, _dspark, DSparkOptions, blocks=True, confidences=True))
    register(Family("dflash", DSparkDrafter, _dspark, blocks=True, confidences=True))  # DSpark's backbone alone


_builtin()
