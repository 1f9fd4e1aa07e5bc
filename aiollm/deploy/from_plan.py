"""A placement plan (aiollm.planner) as a cluster spec that `python -m aiollm serve --config` runs as is.

The plan's instance counts become the spec's; each instance gets `tp x pp` threads, one core standing for one
accelerator of the plan (aiollm's CPU instances have no pipeline stages, so a pp-stage instance runs as one
process with that many cores' threads). A colocated plan becomes the colocated engine, which serves one
instance; more than one is refused.
"""

from __future__ import annotations

from aiollm.deploy.spec import ClusterSpec, SpecError
from aiollm.planner.placement import Plan


def spec_from_plan(plan: Plan, base: ClusterSpec | None = None) -> ClusterSpec:
    """`base` (default: the defaults) with the plan's instances; SpecError when the plan cannot be served."""
    base = base or ClusterSpec()
    decode = plan.decode
    if plan.prefill is None:
        if decode.count != 1:
            raise SpecError(f"decode.count: a colocated plan of {decode.count} instances; aiollm serves one")
        return base.override({"colocated": True, "decode.threads": decode.tp * decode.pp})
    prefill = plan.prefill
    return base.override(
        {
            "prefill.count": prefill.count,
            "prefill.threads": prefill.tp * prefill.pp,
            "decode.count": decode.count,
            "decode.threads": decode.tp * decode.pp,
        }
    )


def plan_header(plan: Plan) -> str:
    """TOML comment lines saying where the spec came from."""
    slo = plan.slo
    lines = [
        f"planned for {plan.model} on {plan.cluster} ({plan.affinity} affinity), workload {plan.workload}",
        f"SLO: TTFT {slo['ttft'] * 1e3:.0f} ms, TPOT {slo['tpot'] * 1e3:.0f} ms, {slo['attainment'] * 100:.0f} %",
        f"goodput {plan.system_goodput:.2f} req/s on {plan.gpus_used} accelerators; latency profile {plan.profile}",
    ]
    return "".join(f"# {line}\n" for line in lines) + "\n"
