"""The one stage graph both executors run (flows/graph.py), and the embedded executor's rule for the stages
that only feed others (flows/graph.py: needed): its shape, its keys, and when a preparation or the reference
is not needed. Real plans, real stage keys (lock hashes), a real registry; no stage runs here."""

from __future__ import annotations

from pathlib import Path

from flows.graph import Graph, StageOutcome, StageStatus, build_graph, needed
from pipeline.plan import EvalSpec, Plan, ServingSpec, SourceInput, variants_from_flags
from pipeline.recipe import Placement
from registry import open_registry


def _plan(**kw: object) -> Plan:
    return Plan(source=SourceInput(source="/nowhere/demo"), model_name="demo",
                variants=variants_from_flags(gguf="Q8_0,Q4_K_M"), **kw)  # type: ignore[arg-type]


def _graph(plan: Plan, nonce: str | None = None) -> Graph:
    return build_graph(plan, "local:sha256:0", Placement(), {"registry": None, "blobs": None}, nonce=nonce)


def test_graph_orders_builds_before_the_reference_and_names_every_dependency() -> None:
    graph = _graph(_plan())
    assert list(graph.nodes) == ["resolve", "prepare:gguf", "build:Q8_0", "register:Q8_0", "build:Q4_K_M",
                                 "register:Q4_K_M", "reference", "evaluate:Q8_0:llama.cpp",
                                 "evaluate:Q4_K_M:llama.cpp"]
    seen: set[str] = set()
    for name, node in graph.nodes.items():
        assert set(node.deps) <= seen, name  # a topological order one process can run as it is
        assert set(node.request.upstream.values()) <= {graph.nodes[d].request.key for d in seen}
        seen.add(name)
    assert graph.dependents("reference") == ["evaluate:Q8_0:llama.cpp", "evaluate:Q4_K_M:llama.cpp"]
    assert "reference" not in _graph(_plan(eval=EvalSpec(enabled=False))).nodes


def test_keys_are_stable_and_force_renews_only_builds_registrations_and_evaluations() -> None:
    one, two = _graph(_plan()), _graph(_plan())
    assert {n: x.request.key for n, x in one.nodes.items()} == {n: x.request.key for n, x in two.nodes.items()}
    forced = _graph(_plan(), nonce="abc")
    changed = {n for n in one.nodes if one.nodes[n].request.key != forced.nodes[n].request.key}
    assert changed == {n for n in one.nodes if n.split(":")[0] in ("build", "register", "evaluate")}
    # the same source under another name: its own versions, the same preparation and reference
    other = _graph(_plan().model_copy(update={"model_name": "other"}))
    renamed = {n for n in one.nodes if one.nodes[n].request.key != other.nodes[n].request.key}
    assert renamed == {n for n in one.nodes if n.split(":")[0] in ("resolve", "build", "register", "evaluate")}
    # another variant leaves the preparation's key alone: adding a type reuses the base
    more = _graph(Plan(source=SourceInput(source="/nowhere/demo"), model_name="demo",
                       variants=variants_from_flags(gguf="Q8_0,Q4_K_M,Q2_K")))
    assert more.nodes["prepare:gguf"].request.key == one.nodes["prepare:gguf"].request.key


def test_feeders_run_only_for_a_stage_that_can_run(tmp_path: Path) -> None:
    reg = open_registry(str(tmp_path / "registry"))
    graph = _graph(_plan())

    def outcome(name: str, status: StageStatus) -> StageOutcome:
        return graph.nodes[name].request.outcome(status)

    # nothing recorded: every build needs the preparation
    assert needed(reg, graph, "prepare:gguf", {"resolve": outcome("resolve", "ran")})
    # every registration failed: no evaluation can run, so the reference is not computed
    failed = {n: outcome(n, "failed") for n in graph.nodes if n.startswith(("build", "register"))}
    assert not needed(reg, graph, "reference", {"resolve": outcome("resolve", "ran"), **failed})
    # one registration finished: its evaluation will run and needs the reference
    failed["register:Q8_0"] = outcome("register:Q8_0", "ran")
    assert needed(reg, graph, "reference", {"resolve": outcome("resolve", "ran"), **failed})
    # a stage that is not a feeder always runs
    assert needed(reg, graph, "build:Q8_0", {})


def test_serving_adds_one_serve_stage_per_variant_after_its_registration() -> None:
    """--serving: serve:VARIANT:ENGINE after register:VARIANT (not after the evaluations: serving needs only
    the files), on the engine's pool, keyed by the serving spec and the engine's and GuideLLM's pins; without
    evaluation too."""
    plain = _graph(_plan())
    assert not any(n.startswith("serve:") for n in plain.nodes)
    served = _graph(_plan(serving=ServingSpec(enabled=True, users=(1, 4))))
    assert [n for n in served.nodes if n.startswith("serve:")] == ["serve:Q8_0:llama.cpp", "serve:Q4_K_M:llama.cpp"]
    node = served.nodes["serve:Q4_K_M:llama.cpp"]
    assert node.deps == ("register:Q4_K_M",) and node.request.upstream["register"] == \
        served.nodes["register:Q4_K_M"].request.key
    other = _graph(_plan(serving=ServingSpec(enabled=True, users=(1, 8))))
    assert other.nodes["serve:Q4_K_M:llama.cpp"].request.key != node.request.key
    assert other.nodes["register:Q4_K_M"].request.key == served.nodes["register:Q4_K_M"].request.key
    no_eval = _graph(_plan(eval=EvalSpec(enabled=False), serving=ServingSpec(enabled=True)))
    assert "reference" not in no_eval.nodes and "serve:Q8_0:llama.cpp" in no_eval.nodes
