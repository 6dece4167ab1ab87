"""gpu_check's NCCL stage: the project's NcclGroup over a one-rank NCCL communicator (NCCL accepts one rank; on one
GPU every real group shares it, so training never builds one): each collective on fp32 and bf16 device buffers
against numpy, through the group's stream, events and handles. Under MPITRAIN_NCCL_STANDIN=1 the same code runs on
numpy arrays through the host stand-in of cupy.cuda.nccl (how CI runs it).
"""
from __future__ import annotations

import json

from gpu_check_process import failed_output, inner, json_lines

NCCL_CHECKS = ("all_reduce", "iall_reduce", "reduce_scatter", "ireduce_scatter", "all_gather", "iall_gather",
               "broadcast", "ibroadcast", "all_to_all", "all_to_allv", "send_recv")
NCCL_DTYPES = ("float32", "bfloat16")
NCCL_ELEMENTS, NCCL_PART = 1 << 18, 1000  # buffer length; all_to_allv's count (the rest must stay untouched)
P2P_TAG = 0  # the pipeline's forward tag: the group gets an NCCL lane for it


def nccl_inner(group_class=None) -> None:
    """Prints "NCCL {...}" (the group), one "CHECK {...}" per collective and dtype, then "CLOSED {...}". Under
    MPITRAIN_NCCL_STANDIN=1 the same code runs on numpy arrays through the host stand-in (how CI runs it).
    group_class: NcclGroup, or a subclass with a planted defect (the tests show that the checks can fail)."""
    import numpy as np
    from mpi4py import MPI

    from mpitrain.backend import BFLOAT16
    from mpitrain.comm.nccl import HostRuntime, make_runtime
    from mpitrain.comm.nccl_group import NcclGroup
    runtime = make_runtime("cuda")
    xp, api = (np, runtime.standin) if isinstance(runtime, HostRuntime) else (runtime.cupy, runtime.nccl)
    group = (group_class or NcclGroup)(MPI.COMM_SELF, "nccl-check", runtime=runtime, p2p_tags=(P2P_TAG,))
    print("NCCL " + json.dumps({"group": type(group).__name__, "runtime": runtime.description, "size": group.size,
                                "communicators": len(group.communicators())}), flush=True)
    rng = np.random.default_rng(0)
    for dtype_name in NCCL_DTYPES:
        host = rng.standard_normal(NCCL_ELEMENTS).astype(np.float32 if dtype_name == "float32" else BFLOAT16)
        for name in NCCL_CHECKS:
            check = {"name": name, "dtype": dtype_name}
            try:
                got, expected = nccl_case(group, name, host, xp, api, runtime)
                wrong = int((bits(got) != bits(expected)).sum())
                check.update(passed=wrong == 0, **({"wrong_elements": wrong} if wrong else {}))
            except Exception as exc:  # noqa: BLE001 (one check failing must not hide the others)
                check.update(passed=False, error=f"{type(exc).__name__}: {exc}")
            print("CHECK " + json.dumps(check), flush=True)
    for communicator in group.communicators():  # NCCL reports some errors only asynchronously
        if hasattr(communicator, "check_async_error"):
            communicator.check_async_error()
    group.close()
    print("CLOSED " + json.dumps({"communicators_left": len(group.communicators())}), flush=True)


def bits(array):
    """The array's bits as unsigned integers of its width: compared exactly, and bf16 needs no arithmetic."""
    return array.view({2: "uint16", 4: "uint32", 8: "uint64"}[array.dtype.itemsize])


def nccl_case(group, name: str, host, xp, api, runtime):
    """Run `name` on device copies of `host`; (what it wrote, on the host; what numpy expects). On one rank every
    collective hands back its input; an output buffer starts as a sentinel, so a short count shows."""
    import numpy as np
    sentinel = np.full_like(host, -7)
    send, recv = (xp.array(bits(a), copy=True).view(a.dtype) for a in (host, sentinel))
    expected = host
    if name in ("all_reduce", "iall_reduce"):
        out = send
        _done(getattr(group, name)(send, op="sum"))
    elif name in ("reduce_scatter", "ireduce_scatter", "all_gather", "iall_gather", "all_to_all"):
        out = recv
        _done(getattr(group, name)(send, recv))
    elif name in ("broadcast", "ibroadcast"):
        out = send
        _done(getattr(group, name)(send, root=0))
    elif name == "all_to_allv":
        out, expected = recv, np.concatenate([host[:NCCL_PART], sentinel[NCCL_PART:]])
        group.all_to_allv(send, [NCCL_PART], recv, [NCCL_PART])
    elif name == "send_recv":
        # A lone send to itself would hold its lane's stream until the receive queued behind it: NCCL's pattern is
        # the pair inside one group call, issued together at its end (after the handles' events were recorded, so
        # every stream is waited for before reading).
        out = recv
        api.groupStart()
        try:
            handles = [group.isend(send, 0, tag=P2P_TAG), group.irecv(recv, 0, tag=P2P_TAG)]
        finally:
            api.groupEnd()
        wait_for_every_stream(runtime)
        for handle in handles:
            handle.wait()
    else:
        raise ValueError(f"no NCCL check named {name!r}")
    return runtime.to_host(bits(out)).view(host.dtype), expected


def _done(handle) -> None:
    if handle is not None:  # the non-blocking forms: the compute stream waits on the group's event
        handle.wait()


def wait_for_every_stream(runtime) -> None:
    from mpitrain.comm.nccl import HostRuntime
    if isinstance(runtime, HostRuntime):
        for stream in list(runtime.standin._streams.values()):  # the stand-in's streams progress when polled
            stream.synchronize()
    else:
        runtime.cupy.cuda.runtime.deviceSynchronize()


def nccl(limit_s: float) -> dict:
    status, output = inner("nccl", limit_s)
    checks = {f"{c['name']} {c['dtype']}": c for c in json_lines(output, "CHECK ")}
    wanted = [f"{name} {dtype}" for dtype in NCCL_DTYPES for name in NCCL_CHECKS]
    failed = [key for key in wanted if not checks.get(key, {}).get("passed")]
    group = (json_lines(output, "NCCL ") or [{}])[-1]
    closed = bool(json_lines(output, "CLOSED "))
    passed = status == 0 and not failed and closed and group.get("size") == 1
    return {"passed": passed, **group, "checks_passed": len(wanted) - len(failed), "checks": len(wanted),
            "failed_checks": {key: checks.get(key, {"error": "not run"}) for key in failed}, "closed": closed,
            **failed_output(not passed, output)}

