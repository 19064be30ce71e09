"""Runs a pipeline of passes with verification, IR printing, dot dumps and timing between passes.

Like MLIR's pass manager: instrumentation hooks run around each pass, a transform's declared
preservations decide which cached analyses survive, and a failure names the pass, the
pipeline so far and the node involved.
"""

from __future__ import annotations

import linecache
import os
import sysconfig
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mutwo.ir.dot import write_dot
from mutwo.ir.graph import Graph
from mutwo.ir.pass_base import Pass, PassContext, PassFailure, write_atomic
from mutwo.ir.printer import format_node, print_graph
from mutwo.ir.verifier import VerificationError, verify

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def library_file(path: str) -> bool:
    """Whether a file is torch's or Python's own (an installed package is neither): never the
    line worth naming as where an error was raised."""
    return path.startswith(_TORCH_DIR) or (path.startswith(_STDLIB_DIR) and not any(p in path for p in _INSTALLED))


def innermost_frame(error: BaseException, skip: Callable[[str], bool] = library_file) -> traceback.FrameSummary | None:
    """The innermost frame of ``error``'s traceback whose absolute path ``skip`` does not refuse
    (nor a ``<string>``); None if there is none."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if "<" not in frame.filename and not skip(os.path.abspath(frame.filename)):
            return frame
    return None


def describe_frame(frame: traceback.FrameSummary) -> str:
    """``file:line in function: code``."""
    code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f"{frame.filename}:{frame.lineno} in {frame.name}" + (f": {code}" if code else "")


class PipelineFailure(RuntimeError):
    """A pass failed, or the graph failed verification after it.

    ``crashed`` tells an exception a pass did not mean to raise (a bug: its message names the
    exception's type and the innermost line outside torch and Python that raised it) from a
    :class:`PassFailure` or a :class:`VerificationError`, which say what is wrong themselves."""

    def __init__(self, pass_name: str, pipeline_so_far: list[str], cause: BaseException) -> None:
        self.pass_name = pass_name
        self.pipeline_so_far = pipeline_so_far
        self.cause = cause
        self.crashed = not isinstance(cause, (PassFailure, VerificationError))
        super().__init__(self._describe(str(cause)))
        #: The message without the advice of a :class:`PassFailure` that gives one: what failed and why.
        self.reason = self._describe(cause.reason) if isinstance(cause, PassFailure) else str(self)

    def _describe(self, cause_text: str) -> str:
        """``pass 'NAME' failed after [...]: `` and the first line of ``cause_text``, with the node involved."""
        cause = self.cause
        node = getattr(cause, "node", None)
        where = f" at {format_node(node)}" if node is not None and node.graph is not None else ""
        first_line = (cause_text.splitlines() or [""])[0]
        if self.crashed:
            frame = innermost_frame(cause) or innermost_frame(cause, lambda path: False)
            raised = f" (raised at {describe_frame(frame)})" if frame is not None else ""
            first_line = f"{type(cause).__name__}{': ' if first_line else ''}{first_line}{raised}"
        after = f"after [{','.join(self.pipeline_so_far)}]" if self.pipeline_so_far else "as the first pass"
        return f"pass '{self.pass_name}' failed {after}: {first_line or type(cause).__name__}{where}"


@dataclass
class Instrumentation:
    """What to do between passes."""

    verify: bool = True
    #: verify after the last pass only, not after each pass that changed the graph: for a pipeline
    #: verified pass by pass on this very graph before (a plan-cache hit replays one), where each
    #: verify of a 10,000-node graph costs about 0.1 s and would find what the last one finds
    verify_once: bool = False
    print_ir_after_all: bool = False
    print_ir_after: frozenset[str] = frozenset()
    dump_dot: bool = False
    time_passes: bool = False
    printer: Callable[[str], None] = print


@dataclass
class PassRecord:
    name: str  #: the pass as written, with options
    seconds: float
    changed: bool
    result: Any = None


@dataclass
class PipelineResult:
    records: list[PassRecord] = field(default_factory=list)

    def timings(self) -> dict[str, float]:
        """Seconds per pass, keyed ``NN-name`` so a pass run twice appears twice."""
        return {f"{i:02d}-{r.name}": round(r.seconds, 6) for i, r in enumerate(self.records, start=1)}

    def timing_report(self) -> str:
        total = sum(r.seconds for r in self.records) or 1e-12
        lines = ["===== pass execution timing =====", f"{'seconds':>10} {'%':>6}  pass"]
        for record in self.records:
            lines.append(f"{record.seconds:10.4f} {100 * record.seconds / total:6.1f}  {record.name}")
        lines.append(f"{total:10.4f} {100.0:6.1f}  total")
        return "\n".join(lines)


class PassManager:
    """Runs passes in order on one graph, sharing one :class:`PassContext`."""

    def __init__(self, passes: Sequence[Pass], instrumentation: Instrumentation | None = None) -> None:
        self.passes = list(passes)
        self.instrumentation = instrumentation or Instrumentation()

    def run(self, graph: Graph, ctx: PassContext) -> PipelineResult:
        inst = self.instrumentation
        result = PipelineResult()
        done: list[str] = []
        ctx.profile_needs = ctx.profile_needs.union(*(pass_.profile_needs for pass_ in self.passes))
        verified: int | None = None  # the graph's version when it was last verified
        for index, pass_ in enumerate(self.passes, start=1):
            label = pass_.describe()
            stem = f"{index:02d}-{pass_.name}"
            if inst.dump_dot and ctx.out_dir is not None:
                write_dot(graph, str(ctx.out_dir / f"{stem}-before.dot"), title=f"before {label}")
            ctx.log(f"[{index}/{len(self.passes)}] {label}")
            version = graph.version
            start = time.perf_counter()
            try:
                output = pass_.run(graph, ctx)
            except (PassFailure, VerificationError) as error:
                raise PipelineFailure(pass_.name, done, error) from error
            except Exception as error:  # a crash inside a pass is reported like a failure, with its cause
                raise PipelineFailure(pass_.name, done, error) from error
            seconds = time.perf_counter() - start
            changed = graph.version != version
            if changed and not pass_.is_transform:
                raise PipelineFailure(pass_.name, done, PassFailure(
                    "an analysis pass changed the graph; declare is_transform = True on a pass that changes it"))
            ctx.analyses.after_transform(graph, version, pass_.preserves)
            # after one of mutwo's analyses, a graph verified since its last change is verified
            # already; a transform may change nodes' kinds or phases, which leave the version as it
            # was, and so may an analysis of one's own that breaks its contract: both are verified
            ours = type(pass_).__module__.startswith("mutwo.")
            changed_since = pass_.is_transform or not ours or graph.version != verified
            due = changed_since and (not inst.verify_once or index == len(self.passes))
            if inst.verify and due:
                try:
                    verify(graph)
                except VerificationError as error:
                    raise PipelineFailure(pass_.name, done, error) from error
                verified = graph.version
            done.append(label)
            result.records.append(PassRecord(label, seconds, changed, output))
            if inst.dump_dot and ctx.out_dir is not None:
                write_dot(graph, str(ctx.out_dir / f"{stem}-after.dot"), title=f"after {label}")
            if inst.print_ir_after_all or pass_.name in inst.print_ir_after:
                text = print_graph(graph)
                written = ctx.out_dir / f"{stem}-after.ir.txt" if ctx.out_dir is not None else None
                if written is not None:
                    write_atomic(written, text)
                if written is not None and pass_.name not in inst.print_ir_after:
                    # After every pass of a big graph the text would flood the terminal: the files have
                    # it, so the terminal gets where (the passes named one by one are printed whole).
                    inst.printer(f"// ----- IR after {label}: {written} ({len(graph)} nodes) -----")
                else:
                    inst.printer(f"// ----- IR after {label} -----\n{text}")
        if inst.time_passes:
            inst.printer(result.timing_report())
        return result
