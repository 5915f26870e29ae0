"""The parallel degrees of a run: how many ranks split the weights (tp), a sample's sequence (sp = ulysses x
ring), the layers (pp, each rank's share in virtual_stages chunks) and the samples (dp). One type, one name per
degree: the RunPlan holds it (megalysses.plan resolves it once), and the grid's rank arithmetic, the sequence
layout and the memory model are built from it and keep no degrees of their own.

    degrees = Degrees(tp=2, sp=4, ring=2, dp=2)       # ulysses 2, world 16
    degrees = Degrees.of_world(16, tp=2, sp=4, ring=2)   # dp from the world (LayoutError where it does not divide)
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """An impossible (world, tp, sp, dp, pp, ring) combination."""


@dataclass(frozen=True)
class Degrees:
    """tp, sp (= ulysses x ring), pp, dp, virtual stages; the world is their product."""

    tp: int = 1
    sp: int = 1                 # every sequence shard of a sample: ulysses x ring
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1     # model chunks per pipeline rank (interleaved 1F1B)
    ring: int = 1               # the ring degree of sp

    def __post_init__(self) -> None:
        bad = [f"{name}={getattr(self, name)}" for name in ("tp", "sp", "pp", "dp", "virtual_stages", "ring")
               if getattr(self, name) < 1]
        if bad:
            raise LayoutError(f"invalid parallel layout: {', '.join(bad)} must be >= 1")
        if self.sp % self.ring:
            raise LayoutError(f"invalid parallel layout: ring={self.ring} does not divide sp={self.sp} "
                              f"(sp = ulysses x ring)")

    @classmethod
    def of_world(cls, world: int, tp: int = 1, sp: int = 1, pp: int = 1, ring: int = 1,
                 virtual_stages: int = 1) -> "Degrees":
        """The degrees of a world of `world` ranks: dp = world / (tp * sp * pp), which must be whole."""
        sizes = (("world", world), ("tp", tp), ("sp", sp), ("pp", pp), ("ring", ring))
        bad = [f"{n}={v}" for n, v in sizes if v < 1]
        mp = tp * sp * pp
        if bad or world % mp:
            rule = f"{', '.join(bad)} must be >= 1" if bad else f"world must be a multiple of tp*sp*pp = {mp}"
            raise LayoutError(f"invalid parallel layout: world={world}, tp={tp}, sp={sp}, pp={pp}, "
                              f"dp=world/(tp*sp*pp)={world / max(mp, 1):g}: {rule} (world = tp*sp*dp*pp)")
        return cls(tp=tp, sp=sp, pp=pp, dp=world // mp, virtual_stages=virtual_stages, ring=ring)

    @property
    def ulysses(self) -> int:
        """The Ulysses (all-to-all) degree of sp."""
        return self.sp // self.ring

    @property
    def world(self) -> int:
        return self.tp * self.sp * self.pp * self.dp

    def summary(self) -> dict[str, int]:
        """tp, sp, pp and dp alone (metrics.jsonl's start marks, a checkpoint's metadata)."""
        return {"tp": self.tp, "sp": self.sp, "pp": self.pp, "dp": self.dp}

    def record(self) -> dict[str, int]:
        """The degrees as plain data, the world and the ulysses x ring split included (runtime.json)."""
        return {"world": self.world, "tp": self.tp, "sp": self.sp, "pp": self.pp, "dp": self.dp,
                "virtual_stages": self.virtual_stages, "ulysses": self.ulysses, "ring": self.ring}
