"""One planner for both papers' numbers: DistServe's prefill and decode instances and, behind each offloaded decode
instance, FastDecode's R-workers, under one resource budget.

Why joint: the two placements compete for the same machines. DistServe's search gives how many prefill and
decode instances meet the SLOs at the rate; FastDecode's model gives, for a decode instance whose step must stay
within the TPOT SLO, the batch B it can run and the R-workers P = B*S*R / (2*T(B)) that keep its attention up
with its S-part. A budget counts every process the cluster runs for these roles (prefill instances, decode
instances, R-workers). When the whole does not fit, R-workers go first (down to none: attention in the decode
instance, as DistServe runs it), then decode and prefill instances, the larger side first, never below one each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiollm.planner.fastdecode import Sizing, size


@dataclass(frozen=True)
class JointPlan:
    """Instance counts for a whole cluster and why."""

    prefill: int
    decode: int
    # R-worker processes behind each decode instance (0: attention in the decode instance)
    r_workers: int
    # the decode batch the TPOT SLO allows (FastDecode's B), and its sizing
    decode_batch: int
    sizing: Sizing | None
    budget: int
    reasoning: list[str] = field(default_factory=list)

    @property
    def processes(self) -> int:
        return self.prefill + self.decode * (1 + self.r_workers)

    def explain(self) -> str:
        return "\n".join(
            [
                *self.reasoning,
                f"=> {self.prefill} prefill + {self.decode} decode instances, {self.r_workers} R-workers each: "
                f"{self.processes} of {self.budget} processes",
            ]
        )


def plan_joint(
    prefill: int,
    decode: int,
    budget: int,
    t_of_b: dict[int, float],
    r_per_token: float,
    seq_len: int,
    tpot_slo: float,
) -> JointPlan:
    """DistServe's counts (`prefill`, `decode`) with FastDecode's R-workers per decode instance, fitted to `budget`
    processes. `t_of_b`: the decode S-part step time by batch (seconds); `r_per_token`: attention seconds per context
    token on one R-worker; `seq_len`: mean prompt + output tokens; `tpot_slo`: the step time the batch must keep."""
    if prefill < 1 or decode < 1:
        raise ValueError(f"need at least one prefill and one decode instance, got {prefill} and {decode}")
    if budget < 2:
        raise ValueError(f"budget: a cluster needs at least 2 processes, got {budget}")
    lines = [f"DistServe's placement: {prefill} prefill + {decode} decode instances"]
    sizing = size(t_of_b, r_per_token, seq_len, latency_target=tpot_slo)
    lines += [f"  {line}" for line in sizing.reasoning]
    workers = sizing.workers
    lines.append(f"FastDecode's sizing: B = {sizing.batch}, P = {workers} R-workers per decode instance")
    while prefill + decode * (1 + workers) > budget:
        if workers > 0:
            workers -= 1
            why = "R-workers first"
        elif decode >= prefill and decode > 1:
            decode -= 1
            why = "then decode instances"
        elif prefill > 1:
            prefill -= 1
            why = "then prefill instances"
        else:
            break
        lines.append(f"over the budget of {budget}: one fewer ({why})")
    return JointPlan(prefill, decode, workers, sizing.batch, sizing, budget, lines)
