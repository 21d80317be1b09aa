"""sixfold-serve's card flags against a repository version's plan: the same cards, or a refusal.

A repository version is served on the cards its plan places it on (``sixfold-partition --cards
--card-spec --out``); the server does not re-place it. ``--cards`` or ``--card-spec`` given with
``--model-repository`` used to be ignored without a word (issue 32.3: the plan's six m2-cards were
used, and memory checks ran against a spec other than the one asked for). Now a flag that agrees
with the plan is accepted, and one that does not refuses the load, naming the flag, the model,
the version and what its plan holds.
"""

from __future__ import annotations

from collections import Counter

from sixfold.partitioner.plan import PartitionPlan

__all__ = ["check_card_flags"]


def check_card_flags(plan: PartitionPlan, model: str, version: str, *, cards: int | None = None,
                     card_spec: str | None = None) -> None:
    """Raise ValueError when ``cards`` (a count) or ``card_spec`` (a spec name) disagree with ``plan``'s cards.

    None: the flag was not given.
    """
    specs = [d.spec.name for d in plan.devices if d.id != "host"]
    held = ", ".join(f"{n} x {s}" for s, n in Counter(specs).items()) or "no card"
    again = (f"drop the flag (a repository version is served as partitioned), or partition it again: "
             f"sixfold-partition ... --cards {cards if cards is not None else len(specs)}"
             f"{f' --card-spec {card_spec}' if card_spec else ''} --out REPO/{model}/VERSION")
    if cards is not None and cards != len(specs):
        raise ValueError(f"--cards {cards}: model '{model}' version {version} was partitioned onto {held}; {again}")
    if card_spec is not None and any(s != card_spec for s in specs):
        raise ValueError(f"--card-spec {card_spec}: model '{model}' version {version} was partitioned onto {held}; "
                         f"{again}")
