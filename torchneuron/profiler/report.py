"""The bottleneck report: one self-contained HTML file, a Markdown summary and the top findings.

``torchneuron profile report DIR`` (or :func:`write_report`) reads the Parquet sets in ``DIR``
(``rank_<r>/``, written by :func:`~torchneuron.profiler.export_parquet.export_parquet`) and
writes ``DIR/report.html`` (plots as PNG, embedded) and ``DIR/report.md`` (plots beside it in
``DIR/report_files/``). Sections: measured host step vs estimated Trainium step with MFU, MBU
and the host-bound share; top ops and modules by estimated device time; a roofline per engine;
host gaps with their source lines; synchronizations and their stalls; collectives and exposed
communication per rank; the memory timeline against the core's HBM; portability findings; and
ranked, concrete suggestions.
"""

from __future__ import annotations

import base64
import glob
import html
import io
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["write_report", "Report", "suggestions"]


@dataclass
class Report:
    html_path: str
    markdown_path: str
    findings: list = field(default_factory=list)  # top suggestions, ranked
    headline: list = field(default_factory=list)  # one line per rank
    plots: dict = field(default_factory=dict)  # name -> PNG bytes


def _us(ns: float) -> str:
    ns = float(ns)
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e3:.1f} us"


def _pct(x: float) -> str:
    return f"{100.0 * float(x):.1f}%"


def _bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _load(directory: str) -> list[dict]:
    from .export_parquet import read_parquet_set

    ranks = []
    for d in sorted(glob.glob(os.path.join(directory, "rank_*"))):
        if not os.path.isdir(d):
            continue
        tables = read_parquet_set(d)
        if "Summary" not in tables:
            continue
        rows = {k: v.to_pylist() for k, v in tables.items()}
        fpath = os.path.join(d, "findings.json")
        rows["findings"] = json.load(open(fpath)) if os.path.exists(fpath) else {}
        rows["dir"] = d
        ranks.append(rows)
    if not ranks:
        raise FileNotFoundError(
            f"no profile in {directory!r}: expected rank_<r>/ directories with Parquet tables "
            "(written by `torchneuron profile run` or torchneuron.profiler.export_parquet)")
    return ranks


def _meta(rank: dict) -> dict:
    out = {}
    for r in rank.get("Metadata", []):
        try:
            out[r["key"]] = json.loads(r["value"])
        except (ValueError, TypeError):
            out[r["key"]] = r["value"]
    return out


# ---------------------------------------------------------------------------------------------
# suggestions
# ---------------------------------------------------------------------------------------------
def suggestions(rank: dict) -> list[dict]:
    """Ranked, concrete suggestions for one rank: ``{"text", "saving_ns", "kind"}`` (saving per
    step; 0 for informational findings)."""
    s = rank["Summary"][0]
    meta = _meta(rank)
    f = rank.get("findings", {})
    steps = max(1, int(s.get("steps", 1)))
    ops = [n for n in rank.get("FrameworkNode", []) if n["level"] == "op"]
    modules = [n for n in rank.get("FrameworkNode", []) if n["level"] == "module"]
    out: list[dict] = []
    est_step = float(s.get("est_step_ns", 0))

    # 1. Host-bound: the device waits for Python to launch kernels.
    hb = float(s.get("host_bound_fraction", 0))
    if hb >= 0.3 and est_step > 0:
        top = max(modules, key=lambda m: m["children"], default=None)
        where = (f" `{top['module_path']}` alone launches {top['children'] / steps:.0f} kernels per step."
                 if top and not top["module_path"].startswith("(") else "")
        out.append({"kind": "host-bound", "saving_ns": hb * est_step, "text":
                    f"The device would be idle {_pct(hb)} of the estimated step waiting for the host "
                    f"to launch {s.get('kernels_per_step', 0):.0f} kernels per step: compile the model "
                    f"(`model = torch.compile(model, backend=\"neuron\")`) so it launches few, fused "
                    f"kernels.{where}"})

    # 2. fp32 matmuls: TensorE runs fp32 at about a quarter of its bf16 rate.
    fp32 = [n for n in ops if n["engine"] == "tensor" and n["dtype"] == "float32"]
    if fp32:
        t = sum(n["est_ns"] for n in fp32) / steps
        ratio = float(meta.get("peak_fp32_flops", 1)) / float(meta.get("peak_bf16_flops", 1) or 1)
        out.append({"kind": "dtype", "saving_ns": t * (1 - ratio), "text":
                    f"{len(fp32) / steps:.0f} matmul-class ops per step run in float32 ({_us(t)} per step "
                    f"estimated); TensorE's fp32 rate is {_pct(ratio)} of bf16: use bf16 autocast "
                    f"(`with torch.autocast(\"neuron\", dtype=torch.bfloat16):` around the forward pass)."})

    # 3. Memory-bound ops far from the HBM roof.
    by_op: dict = defaultdict(lambda: {"est_ns": 0.0, "bytes": 0, "count": 0, "source": ""})
    for n in ops:
        if n["bound"] == "memory":
            k = (n["node_name"], n["source"])
            d = by_op[k]
            d["est_ns"] += n["est_ns"]
            d["bytes"] += n["bytes_read"] + n["bytes_written"]
            d["count"] += 1
    bw = float(meta.get("hbm_bytes_per_s", 1) or 1)
    total_est = sum(n["est_ns"] for n in ops) or 1.0
    for (name, src), d in sorted(by_op.items(), key=lambda kv: -kv[1]["est_ns"])[:3]:
        mbu = d["bytes"] / (d["est_ns"] * 1e-9 * bw) if d["est_ns"] else 0.0
        if d["est_ns"] / total_est < 0.02 or mbu > 0.6:
            continue
        ideal = d["bytes"] / (0.8 * bw) * 1e9
        out.append({"kind": "memory-bound", "saving_ns": max(0.0, d["est_ns"] - ideal) / steps, "text":
                    f"`{name}`{' at ' + src if src else ''} is memory-bound at {_pct(mbu)} of HBM bandwidth "
                    f"({d['count'] / steps:.0f} calls, {_us(d['est_ns'] / steps)} per step): fuse it with "
                    f"the ops that produce or consume its operands (torch.compile) so the data crosses "
                    f"HBM once."})

    # 3b. Kernels too small to amortise the per-kernel fixed cost.
    lat = [n for n in ops if n["bound"] == "latency"]
    if ops and len(lat) / len(ops) > 0.5:
        fixed = float(meta.get("kernel_fixed_s", 0)) * 1e9
        t = sum(n["est_ns"] for n in lat) / steps
        useful = sum(max(0.0, n["est_ns"] - fixed) for n in lat) / steps
        out.append({"kind": "latency-bound", "saving_ns": max(0.0, t - useful) * 0.8, "text":
                    f"{len(lat) / steps:.0f} of {len(ops) / steps:.0f} kernels per step are too small to "
                    f"amortise the per-kernel fixed cost ({_us(fixed)}): larger batches or a compiled "
                    f"graph (fewer, fused kernels) recover most of {_us(t - useful)} per step."})

    # 4. Attention without the NKI kernel.
    attn = [n for n in ops if "scaled_dot_product" in n["node_name"] or "attention" in n["kernels"]]
    nki_attn = any("nki::" in n["kernels"] for n in ops)
    if attn and not nki_attn:
        t = sum(n["est_ns"] for n in attn) / steps
        mfu = (sum(n["flops"] for n in attn) / steps) / (t * 1e-9 * float(meta.get("peak_bf16_flops", 1))) if t else 0
        out.append({"kind": "nki", "saving_ns": t * max(0.0, 1 - mfu / 0.5), "text":
                    f"Attention takes {_us(t)} per step at {_pct(mfu)} estimated MFU through the generic "
                    f"kernel: enable the NKI attention kernel (`TORCHNEURON_NKI_SDPA=1`, or "
                    f"`torchneuron.nkilib.sdpa.enable()`)."})

    # 5. Synchronizations.
    syncs: dict = defaultdict(lambda: {"stall": 0, "count": 0})
    for x in f.get("syncs", []):
        k = (x["name"], x.get("source", ""))
        syncs[k]["stall"] += x.get("est_stall_ns", 0)
        syncs[k]["count"] += 1
    for (name, src), d in sorted(syncs.items(), key=lambda kv: -kv[1]["stall"])[:3]:
        if d["stall"] <= 0:
            continue
        out.append({"kind": "sync", "saving_ns": d["stall"] / steps, "text":
                    f"`{name}`{' at ' + src if src else ''} makes the host wait for the device "
                    f"{d['count'] / steps:.1f} times per step ({_us(d['stall'] / steps)} stall per step "
                    f"estimated): avoid `.item()`/`.cpu()`/`print(tensor)` in the loop (log every N "
                    f"steps, or keep the value on the device)."})

    # 6. Exposed communication.
    cc = rank.get("CcOp", [])
    if cc:
        exposed = sum(c["exposed_ns"] for c in cc) / steps
        total = sum(c["est_ns"] for c in cc) / steps
        if total and exposed / total > 0.1:
            out.append({"kind": "communication", "saving_ns": exposed, "text":
                        f"{_pct(exposed / total)} of the estimated communication ({_us(exposed)} of "
                        f"{_us(total)} per step) is not overlapped with compute: overlap it (DDP "
                        f"`bucket_cap_mb`, FSDP prefetching) or compute while it runs."})

    # 7. Portability: what differs on a real Trainium (one finding per kind, top places named).
    by_kind: dict = defaultdict(list)
    for p in f.get("portability", []):
        by_kind[p["kind"]].append(p)
    for kind, items in by_kind.items():
        places = []
        for p in items:
            w = f"`{p['kernel']}` ({p['source'] or 'unknown source'})"
            if w not in places:
                places.append(w)
        where = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
        if kind == "64-bit":
            dts = sorted({d for p in items for d in p["detail"].split(":", 1)[1].split(",")})
            text = (f"{'/'.join(dts)} tensors reach device ops: {where}. Trainium's eager backend narrows "
                    f"64-bit types (float64 to float32, int64 to int32): use the 32-bit types explicitly "
                    f"so results match the device.")
        elif kind == "no-lowering":
            ops_ = sorted({p["detail"].split(":", 1)[1] for p in items})
            text = (f"{', '.join(ops_)} ({where}) have no device lowering in AWS's backend (random numbers "
                    f"are generated on the host CPU there): each call is a host round trip on Trainium.")
        elif kind == "cpu-tensor":
            text = f"Device ops read CPU tensors: {where}. Move those tensors to the device once, outside the loop."
        else:
            n = sum(p["count"] for p in items) / steps
            text = (f"{n:.1f} host-to-device copies per step: {where}. Create the tensors on the device, or "
                    f"pin them and copy with `non_blocking=True` ahead of use.")
        out.append({"kind": "portability", "saving_ns": 0.0, "text": text})

    out.sort(key=lambda x: -x["saving_ns"])
    return out


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - only without the extra
        raise ImportError("the report needs matplotlib: pip install 'torchneuron[profiler]'") from exc
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _roofline(rank: dict) -> bytes:
    plt = _plt()
    meta = _meta(rank)
    bw = float(meta.get("hbm_bytes_per_s", 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"tensor": "tab:red", "vector": "tab:blue", "scalar": "tab:green", "gpsimd": "tab:purple",
              "dma": "tab:gray"}
    ops = [n for n in rank.get("FrameworkNode", []) if n["level"] == "op" and n["est_ns"] > 0]
    xs_all = []
    for eng, col in colors.items():
        pts = [(n["flops"] / max(n["bytes_read"] + n["bytes_written"], 1), n["flops"] / (n["est_ns"] * 1e-9))
               for n in ops if n["engine"] == eng and n["flops"] > 0]
        if pts:
            xs, ys = zip(*pts)
            xs_all += xs
            ax.scatter(xs, ys, s=12, alpha=0.6, color=col, label=f"{eng} ops")
    lo, hi = (min(xs_all) / 2, max(xs_all) * 2) if xs_all else (0.01, 1000)
    import numpy as np

    x = np.logspace(np.log10(max(lo, 1e-3)), np.log10(max(hi, 10)), 100)
    for name, peak, style in (("TensorE bf16", meta.get("peak_bf16_flops", 0), "-"),
                              ("TensorE fp32", meta.get("peak_fp32_flops", 0), "--")):
        if peak:
            ax.plot(x, np.minimum(float(peak), x * bw), style, color="black", lw=1, label=f"{name} roof")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("estimated FLOP/s")
    ax.set_title(f"Roofline ({meta.get('label', 'estimated')}), rank {rank['Summary'][0]['rank']}")
    ax.legend(fontsize=7)
    return _png(fig)


def _time_by_engine(ranks: list) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    engines = ["tensor", "vector", "scalar", "gpsimd", "dma", "collective", "model"]
    labels = []
    bottoms_m: list = []
    data = []
    for r in ranks:
        steps = max(1, r["Summary"][0]["steps"])
        by = defaultdict(float)
        for n in r.get("FrameworkNode", []):
            if n["level"] == "op":
                by[n["engine"] or "other"] += n["est_ns"] / steps / 1e3
        data.append(by)
        labels.append(f"rank {r['Summary'][0]['rank']}")
    left = [0.0] * len(ranks)
    for eng in engines:
        vals = [d.get(eng, 0.0) for d in data]
        if any(vals):
            ax.barh(labels, vals, left=left, label=eng)
            left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("estimated device time per step by engine (us)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=4)
    del bottoms_m
    return _png(fig)


def _gantt(rank: dict) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3))
    ops = [n for n in rank.get("FrameworkNode", []) if n["level"] == "op" and n["est_end_ts"] > 0]
    steps = [n for n in rank.get("FrameworkNode", []) if n["level"] == "step"]
    last = max((n["step"] for n in ops), default=-1)
    sel = [n for n in ops if n["step"] == last] or ops[-200:]
    if sel:
        t0 = min(n["est_start_ts"] for n in sel)
        colors = {"tensor": "tab:red", "vector": "tab:blue", "scalar": "tab:green", "gpsimd": "tab:purple",
                  "dma": "tab:gray", "collective": "tab:orange"}
        for n in sel:
            lane = "collective" if n["engine"] == "collective" else f"queue {n['device']}"
            ax.barh(lane, (n["est_end_ts"] - n["est_start_ts"]) / 1e3, left=(n["est_start_ts"] - t0) / 1e3,
                    color=colors.get(n["engine"], "tab:gray"), height=0.6)
        ax.set_xlabel("estimated time in the step (us)")
    ax.set_title(f"Estimated device queues, step {last if last >= 0 else '-'} ({len(steps)} steps profiled)")
    return _png(fig)


def _memory(ranks: list) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    cap = 0
    for r in ranks:
        rows = r.get("HbmUsage", [])
        if not rows:
            continue
        t0 = rows[0]["ts"]
        ax.plot([(x["ts"] - t0) / 1e6 for x in rows], [x["allocated"] / 2**20 for x in rows],
                label=f"rank {r['Summary'][0]['rank']} allocated")
        ax.plot([(x["ts"] - t0) / 1e6 for x in rows], [x["reserved"] / 2**20 for x in rows], "--",
                label=f"rank {r['Summary'][0]['rank']} reserved")
        cap = max(cap, rows[0]["capacity"])
        ooms = [x for x in rows if x["event"] == "oom"]
        if ooms:
            ax.scatter([(x["ts"] - t0) / 1e6 for x in ooms], [x["allocated"] / 2**20 for x in ooms],
                       color="red", marker="x", label="OOM")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("MiB")
    title = "Device memory"
    if cap:
        title += f" (HBM per core: {cap / 2**30:.0f} GiB)"
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return _png(fig)


def _comm(ranks: list) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3))
    labels, total, exposed = [], [], []
    for r in ranks:
        steps = max(1, r["Summary"][0]["steps"])
        cc = r.get("CcOp", [])
        labels.append(f"rank {r['Summary'][0]['rank']}")
        total.append(sum(c["est_ns"] for c in cc) / steps / 1e3)
        exposed.append(sum(c["exposed_ns"] for c in cc) / steps / 1e3)
    ax.bar(labels, total, label="estimated communication")
    ax.bar(labels, exposed, label="exposed (not overlapped)")
    ax.set_ylabel("us per step")
    ax.legend(fontsize=7)
    return _png(fig)


# ---------------------------------------------------------------------------------------------
# the document
# ---------------------------------------------------------------------------------------------
def _table(headers: list, rows: list) -> tuple[str, str]:
    h = "<table><tr>" + "".join(f"<th>{html.escape(str(x))}</th>" for x in headers) + "</tr>"
    for r in rows:
        h += "<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>"
    h += "</table>"
    md = "| " + " | ".join(str(x) for x in headers) + " |\n|" + "---|" * len(headers) + "\n"
    for r in rows:
        md += "| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |\n"
    return h, md


def write_report(directory: str, html_path: str | None = None, markdown_path: str | None = None,
                 top: int = 20) -> Report:
    """Write the report of the profile in ``directory``; returns the paths and top findings."""
    ranks = _load(directory)
    html_path = html_path or os.path.join(directory, "report.html")
    markdown_path = markdown_path or os.path.join(directory, "report.md")
    files = os.path.join(os.path.dirname(markdown_path), "report_files")
    os.makedirs(files, exist_ok=True)
    meta = _meta(ranks[0])
    rep = Report(html_path, markdown_path)
    sections: list[tuple[str, str, str]] = []  # title, html, md

    # 1. headline
    rows = []
    for r in ranks:
        s = r["Summary"][0]
        speed = s["measured_step_ns"] / s["est_step_ns"] if s["est_step_ns"] else 0
        rows.append([s["rank"], _us(s["measured_step_ns"]), _us(s["est_step_ns"]), f"{speed:.1f}x",
                     _pct(s["est_mfu"]), _pct(s["est_mbu"]), _pct(s["host_bound_fraction"]),
                     f"{s['kernels_per_step']:.0f}", s["steps"]])
        rep.headline.append(
            f"rank {s['rank']}: measured host step {_us(s['measured_step_ns'])} (emulator) vs estimated "
            f"{meta.get('chip', '')} step {_us(s['est_step_ns'])}; est. MFU {_pct(s['est_mfu'])}, "
            f"MBU {_pct(s['est_mbu'])}, host-bound {_pct(s['host_bound_fraction'])}")
    h, m = _table(["rank", "measured host step (emulator)", f"estimated {meta.get('chip', '')} step",
                   "ratio", "est. MFU", "est. MBU", "host-bound", "kernels/step", "steps"], rows)
    sections.append(("Step time: emulator vs estimated Trainium", h, m))

    # 2. suggestions (rank 0's, plus other ranks' communication findings)
    sugg = suggestions(ranks[0])
    for r in ranks[1:]:
        sugg += [x for x in suggestions(r) if x["kind"] == "communication"]
    sugg.sort(key=lambda x: -x["saving_ns"])
    rep.findings = sugg
    rows = [[i + 1, (_us(x["saving_ns"]) + "/step") if x["saving_ns"] else "-", x["text"]]
            for i, x in enumerate(sugg[:top])]
    h, m = _table(["#", "est. saving", "suggestion"], rows or [["-", "-", "no findings"]])
    sections.append(("Suggestions (ranked by estimated saving)", h, m))

    r0 = ranks[0]
    steps0 = max(1, r0["Summary"][0]["steps"])
    ops = [n for n in r0.get("FrameworkNode", []) if n["level"] == "op"]
    est_step = r0["Summary"][0]["est_step_ns"] or 1.0
    # 3. top ops
    agg: dict = defaultdict(lambda: {"count": 0, "flops": 0, "bytes": 0, "est": 0.0, "cpu": 0, "bound": "",
                                     "engine": "", "source": ""})
    for n in ops:
        a = agg[n["node_name"]]
        a["count"] += 1
        a["flops"] += n["flops"]
        a["bytes"] += n["bytes_read"] + n["bytes_written"]
        a["est"] += n["est_ns"]
        a["cpu"] += n["measured_host_ns"]
        a["bound"] = a["bound"] or n["bound"]
        a["engine"] = a["engine"] or n["engine"]
        a["source"] = a["source"] or n["source"]
    rows = []
    for name, a in sorted(agg.items(), key=lambda kv: -kv[1]["est"])[:top]:
        rows.append([name, f"{a['count'] / steps0:.1f}", f"{a['flops'] / steps0 / 1e6:.2f}",
                     _bytes(a["bytes"] / steps0), f"{a['flops'] / max(a['bytes'], 1):.1f}", a["engine"], a["bound"],
                     _us(a["est"] / steps0), _pct(a["est"] / steps0 / est_step), _us(a["cpu"] / steps0), a["source"]])
    h, m = _table(["op", "calls/step", "MFLOP/step", "bytes/step", "FLOP/B", "engine", "bound",
                   "est. time/step", "share of step", "measured CPU/step", "first source"], rows)
    sections.append(("Top ops by estimated device time", h, m))
    # 4. top modules
    mods = [n for n in r0.get("FrameworkNode", []) if n["level"] == "module"]
    rows = [[n["module_path"], f"{n['children'] / steps0:.0f}", _us(n["est_ns"] / steps0),
             _pct(n["mfu"]), _pct(n["mbu"]), _us(n["measured_device_ns"] / steps0)]
            for n in sorted(mods, key=lambda n: -n["est_ns"])[:top]]
    h, m = _table(["module", "kernels/step", "est. time/step", "est. MFU", "est. MBU",
                   "measured device/step"], rows)
    sections.append(("Top modules by estimated device time", h, m))

    # plots
    rep.plots = {"roofline": _roofline(r0), "engines": _time_by_engine(ranks), "gantt": _gantt(r0),
                 "memory": _memory(ranks), "communication": _comm(ranks)}
    for name, png in rep.plots.items():
        with open(os.path.join(files, f"{name}.png"), "wb") as fh:
            fh.write(png)

    def img(name: str) -> tuple[str, str]:
        b64 = base64.b64encode(rep.plots[name]).decode()
        return (f'<img alt="{name}" src="data:image/png;base64,{b64}"/>',
                f"![{name}](report_files/{name}.png)\n")

    h, m = img("roofline")
    sections.append(("Roofline per engine", h, m))
    h, m = img("engines")
    h2, m2 = img("gantt")
    sections.append(("Estimated device time by engine; estimated queues of the last step", h + h2, m + m2))

    # 5. host gaps
    gaps = r0.get("findings", {}).get("host_gaps", [])
    rows = [[g["source"] or "(unknown)", g["function"], g["module"], g["gaps"], _us(g["gap_ns"] / steps0),
             g["next_kernel"]] for g in gaps[:top]]
    h, m = _table(["source", "function", "module", "gaps", "device idle/step", "next kernel"],
                  rows or [["-", "", "", 0, "-", ""]])
    sections.append(("Host gaps: device idle while Python dispatches", h, m))
    # 6. syncs
    syncs = r0.get("findings", {}).get("syncs", [])
    sagg: dict = defaultdict(lambda: [0, 0])
    for x in syncs:
        sagg[(x["name"], x.get("source", ""))][0] += 1
        sagg[(x["name"], x.get("source", ""))][1] += x.get("est_stall_ns", 0)
    rows = [[k[0], k[1], v[0], _us(v[1] / steps0)] for k, v in sorted(sagg.items(), key=lambda kv: -kv[1][1])]
    h, m = _table(["synchronization", "source", "count", "est. stall/step"], rows or [["-", "", 0, "-"]])
    sections.append(("Synchronizations and their stalls", h, m))
    # 7. collectives
    rows = []
    for r in ranks:
        cc = r.get("CcOp", [])
        steps = max(1, r["Summary"][0]["steps"])
        by = defaultdict(lambda: [0, 0, 0.0, 0.0])
        for c in cc:
            b = by[c["collective"] or c["name"]]
            b[0] += 1
            b[1] += c["bytes"]
            b[2] += c["est_ns"]
            b[3] += c["exposed_ns"]
        for name, b in by.items():
            rows.append([r["Summary"][0]["rank"], name, f"{b[0] / steps:.1f}", _bytes(b[1] / steps),
                         _us(b[2] / steps), _us(b[3] / steps)])
    h, m = _table(["rank", "collective", "calls/step", "bytes/step", "est. time/step", "exposed/step"],
                  rows or [["-", "none", 0, "-", "-", "-"]])
    h2, m2 = img("communication")
    sections.append(("Collectives and exposed communication per rank", h + (h2 if rows else ""),
                     m + (m2 if rows else "")))
    # 8. memory
    s = r0["Summary"][0]
    h, m = img("memory")
    note = (f"<p>Peak allocated {_bytes(s['hbm_peak_allocated'])} of {_bytes(s['hbm_capacity'])} HBM per "
            f"core; {s['ooms']} out-of-memory event(s). Memory events need <code>profile_memory=True</code>."
            f"</p>")
    sections.append(("Memory timeline against per-core HBM", note + h,
                     html.unescape(note.replace("<p>", "").replace("</p>", "\n").replace("<code>", "`")
                                   .replace("</code>", "`")) + m))
    # 9. portability
    port = r0.get("findings", {}).get("portability", [])
    rows = [[p["kind"], p["detail"], p["kernel"], p["source"], p["count"]] for p in port[:top]]
    h, m = _table(["finding", "detail", "kernel", "source", "count"], rows or [["none", "", "", "", 0]])
    sections.append(("Portability to a real Trainium", h, m))

    title = f"torchneuron profile: {meta.get('chip', '')} estimate ({meta.get('platform', '')}, LNC={meta.get('lnc', '')})"
    assumptions = ("Estimates model each device activity with the platform table's peaks "
                   "(roofline plus a fixed per-kernel cost) and replay the launches on a virtual "
                   "host clock; see docs/profiling.md for every assumption.")
    body = "".join(f"<h2>{html.escape(t)}</h2>\n{h}\n" for t, h, _ in sections)
    doc = (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
           "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
           "margin:0.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:left}"
           "th{background:#eee}img{max-width:100%}</style></head><body>"
           f"<h1>{html.escape(title)}</h1><p>{html.escape(assumptions)}</p>\n{body}</body></html>")
    with open(html_path, "w") as fh:
        fh.write(doc)
    md = f"# {title}\n\n{assumptions}\n\n" + "".join(f"## {t}\n\n{m}\n" for t, _, m in sections)
    with open(markdown_path, "w") as fh:
        fh.write(md)
    return rep
