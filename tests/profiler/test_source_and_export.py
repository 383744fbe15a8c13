"""Source attribution (eager, backward, compiled), Parquet export, the report, HTA and Perfetto
readability, on the demo GPT profiled once for the session (conftest.gpt_profile)."""

import base64
import html.parser
import inspect
import json
import os

import pytest
import torch
from profiling_helpers import ACTIVITIES, EXAMPLES, device_events

import gpt as gpt_module
from torchneuron.profiler.analysis import analyze_trace
from torchneuron.profiler.export_parquet import SCHEMA_VERSION, TABLES, export_parquet, read_parquet_set
from torchneuron.profiler.report import write_report


def _line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


def test_eager_kernels_carry_the_user_line_function_and_module_path(gpt_profile):
    _, trace, _ = gpt_profile
    qkv_line = _line_of(gpt_module.CausalSelfAttention.forward, "self.qkv(x)")
    qkv = [e for e in device_events(trace, "kernel") if e["args"].get("module") == "GPT.blocks.0.attn.qkv"]
    assert qkv and all(e["name"] == "nc::addmm" for e in qkv)
    assert {e["args"]["source"] for e in qkv} == {f"{os.path.join(EXAMPLES, 'gpt.py')}:{qkv_line}"}
    assert {e["args"]["function"] for e in qkv} == {"forward"}


def test_backward_kernels_are_attributed_to_their_forward_module(gpt_profile):
    _, trace, _ = gpt_profile
    a = analyze_trace(trace)
    back = [e for e in a.device_events if e.get("phase") == "backward" and e.get("module")]
    assert back
    mods = {e["module"] for e in back}
    assert "GPT.blocks.1.attn.qkv (backward)" in mods
    assert all(m.endswith("(backward)") for m in mods)


def test_compiled_kernels_are_mapped_to_their_fx_nodes_source(tmp_path):
    def f(x):
        y = torch.sin(x) * 2  # fused into one Inductor kernel
        return y + 1

    line = _line_of(f, "torch.sin(x)")
    cf = torch.compile(f, backend="neuron")
    x = torch.randn(64, device="neuron")
    cf(x)
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        out = cf(x)
    assert torch.allclose(out.cpu(), torch.sin(x.cpu()) * 2 + 1, atol=1e-6)
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    (k,) = device_events(json.loads(path.read_text()), "compiled")
    assert k["name"].startswith("cpp_fused")
    assert k["args"]["source"] == f"{__file__}:{line}"
    assert k["args"]["flops"] == 3 * 64  # sin, mul, add per element
    assert k["args"]["bytes_read"] == 64 * 4 and k["args"]["bytes_written"] == 64 * 4


def _compiled_kernel_source(fn, x, tmp_path) -> str:
    cf = torch.compile(fn, backend="neuron")
    cf(x)
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        cf(x)
    path = tmp_path / f"{fn.__module__}.json"
    prof.export_chrome_trace(str(path))
    (k,) = device_events(json.loads(path.read_text()), "compiled")
    return k["args"]["source"]


def test_compile_cache_hit_from_another_file_reports_this_files_source(tmp_path, monkeypatch):
    import importlib.util

    # Inductor's cache keys leave out stack traces: the second file's graph (the same code,
    # lines moved down by an edit) would be a hit that carries the first file's attribution.
    monkeypatch.setenv("TORCHNEURON_COMPILE_CACHE_DIR", str(tmp_path / "cache"))
    body = "import torch\n{pad}def f(x):\n    return torch.cos(x) * 3 + 1\n"
    sources = []
    for name, pad in (("first_copy", ""), ("edited_copy", "\n\n\n")):
        path = tmp_path / f"{name}.py"
        path.write_text(body.format(pad=pad))
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sources.append(_compiled_kernel_source(mod.f, torch.randn(32, device="neuron"), tmp_path))
    assert sources == [f"{tmp_path / 'first_copy.py'}:3", f"{tmp_path / 'edited_copy.py'}:6"]


def test_parquet_set_round_trips_with_a_versioned_schema(gpt_profile, tmp_path):
    import pyarrow as pa

    from torchneuron.profiler.export_parquet import SCHEMAS

    _, trace, _ = gpt_profile
    out = export_parquet(trace, str(tmp_path), rank=0)
    tables = read_parquet_set(out)
    assert set(tables) == set(TABLES)
    for name, table in tables.items():
        assert table.schema.metadata[b"torchneuron.schema_version"] == SCHEMA_VERSION.encode()
        assert [(f.name, f.type) for f in table.schema] == [(n, t) for n, t in SCHEMAS[name]]
    nodes = tables["FrameworkNode"].to_pylist()
    addmm = [n for n in nodes if n["level"] == "op" and n["node_name"] == "aten::addmm"]
    assert addmm and all(n["flops"] > 0 and n["engine"] == "tensor" and 0 < n["mfu"] <= 1 for n in addmm)
    assert {n["level"] for n in nodes} == {"op", "module", "step"}
    assert len([n for n in nodes if n["level"] == "step"]) == 3
    frames = {r["stack_frame_id"] for r in tables["StackFrame"].to_pylist()}
    assert {n["stack_frame_id"] for n in addmm} <= frames
    sources = {r["trace_event_source"] for r in tables["SystemProfileEvents"].to_pylist()}
    assert {"cpu_op", "kernel", "memcpy", "est_kernel", "memory"} <= sources
    hbm = tables["HbmUsage"].to_pylist()
    assert hbm and all(r["capacity"] > 0 for r in hbm)
    meta = {r["key"]: r["value"] for r in tables["Metadata"].to_pylist()}
    assert meta["schema_version"] == SCHEMA_VERSION and meta["platform"] == "trn2"
    (summary,) = tables["Summary"].to_pylist()
    assert summary["steps"] == 3 and summary["est_step_ns"] > 0 and 0 < summary["host_bound_fraction"] <= 1


class _Html(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.imgs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])


def test_report_is_self_contained_html_with_plots_markdown_and_findings(gpt_profile, tmp_path):
    _, trace, _ = gpt_profile
    export_parquet(trace, str(tmp_path), rank=0)
    rep = write_report(str(tmp_path))
    p = _Html()
    p.feed(open(rep.html_path).read())
    assert p.tags.count("table") >= 7 and len(p.imgs) >= 4
    for src in p.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    md = open(rep.markdown_path).read()
    for title in ("Step time", "Top ops", "Top modules", "Roofline", "Host gaps", "Synchronizations",
                  "Collectives", "Memory timeline", "Portability", "Suggestions"):
        assert title in md
    kinds = [f["kind"] for f in rep.findings]
    assert "host-bound" in kinds and "dtype" in kinds  # eager fp32 GPT: both apply
    assert rep.findings[0]["saving_ns"] >= rep.findings[-1]["saving_ns"]


def test_report_of_a_directory_without_profile_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="rank_<r>"):
        write_report(str(tmp_path))


def test_holistic_trace_analysis_reads_the_trace(gpt_profile, tmp_path):
    from hta.trace_analysis import TraceAnalysis

    _, trace, _ = gpt_profile
    trace = dict(trace)
    trace["distributedInfo"] = {"rank": 0, "world_size": 1}
    # HTA subtracts sums of timestamps in float64 (`sum(end) - sum(ts)` over thousands of
    # kernels) and asserts `non_compute_time >= 0`; fractional microseconds make those sums
    # inexact, so when the memory kernels hide under compute ones (a timing accident of a loaded
    # machine) it fails by ~1e-9 us. Rebase to 0 and snap each interval to whole microseconds
    # (ordering kept), so every sum is exact.
    t0 = min(e["ts"] for e in trace["traceEvents"] if "ts" in e)

    def snapped(e):
        if "ts" not in e:
            return e
        start = round(e["ts"] - t0)
        if "dur" not in e:
            return dict(e, ts=start)
        return dict(e, ts=start, dur=round(e["ts"] - t0 + e["dur"]) - start)

    trace["traceEvents"] = [snapped(e) for e in trace["traceEvents"]]
    (tmp_path / "rank0.json").write_text(json.dumps(trace))
    ta = TraceAnalysis(trace_dir=str(tmp_path))
    temporal = ta.get_temporal_breakdown(visualize=False)
    assert temporal["compute_time(us)"].iloc[0] > 0 and temporal["idle_time(us)"].iloc[0] >= 0
    kernels, _ = ta.get_gpu_kernel_breakdown(visualize=False)
    assert {"COMPUTATION", "MEMORY"} <= set(kernels["kernel_type"])
    idle = ta.get_idle_time_breakdown(visualize=False)
    assert len(idle[0]) > 0


def test_trace_has_what_perfettos_json_importer_needs(gpt_profile):
    _, trace, _ = gpt_profile
    json.loads(json.dumps(trace))  # valid JSON
    evs = trace["traceEvents"]
    assert all("ph" in e for e in evs)
    for e in evs:
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert "pid" in e and "tid" in e and "name" in e
    starts = {e["id"] for e in evs if e.get("ph") == "s" and e.get("cat") == "ac2g"}
    ends = {e["id"] for e in evs if e.get("ph") == "f" and e.get("cat") == "ac2g"}
    assert ends and ends <= starts
    names = {e["pid"]: e["args"]["name"] for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"}
    est_pids = {e["pid"] for e in evs if e.get("cat") == "neuron_estimate"}
    assert est_pids and all(names[p].endswith("Trainium2 (estimated)") for p in est_pids)
    assert len([e for e in evs if e.get("cat") == "neuron_estimate"]) == len(device_events(trace))


def test_replayed_compiled_graphs_show_their_kernels_attributed_while_profiled(tmp_path):
    # mode="reduce-overhead" replays its recording under the profiler too: the replayed kernel
    # is its launch's compiled activity (name, source line, FLOPs, bytes), tagged with the graph
    def f(x):
        return torch.sin(x) * 2 + 1

    line = _line_of(f, "torch.sin(x)")
    cf = torch.compile(f, backend="neuron", mode="reduce-overhead")
    x = torch.randn(64, device="neuron")
    torch.neuron.reset_dynamo_metrics()
    cf(x), cf(x)  # warm-up, recording
    assert torch.neuron.get_dynamo_metrics()["graph_replays"] == 1
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        out = cf(x)
    torch.testing.assert_close(out.cpu(), torch.sin(x.cpu()) * 2 + 1)
    assert torch.neuron.get_dynamo_metrics()["graph_replays"] == 2
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    (k,) = device_events(json.loads(path.read_text()), "compiled")
    assert k["name"].startswith("cpp_fused") and "graph" in k["args"]
    assert k["args"]["source"] == f"{__file__}:{line}"
    assert k["args"]["flops"] == 3 * 64
    assert k["args"]["bytes_read"] == 64 * 4 and k["args"]["bytes_written"] == 64 * 4


def test_a_signature_first_seen_while_profiled_runs_compiled_and_is_not_recorded(tmp_path):
    cf = torch.compile(lambda x: torch.cos(x) * 3 - 1, backend="neuron", mode="reduce-overhead")
    x = torch.randn(64, device="neuron")
    torch.neuron.reset_dynamo_metrics()
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        for _ in range(3):
            out = cf(x)
    torch.testing.assert_close(out.cpu(), torch.cos(x.cpu()) * 3 - 1)
    metrics = torch.neuron.get_dynamo_metrics()
    assert metrics["graph_replays"] == 0 and metrics.get("graphs_recorded", 0) == 0
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    evs = device_events(json.loads(path.read_text()), "compiled")
    assert len(evs) == 3 and not any("graph" in e["args"] for e in evs)
