"""Speculator service: hosts SSMs, keeps per-request SSM KV caches, streams token trees.

Model-free pool members (prompt lookup, suffix speculation) may run here next to the SSMs: their
deterministic drafts merge into the same tree, within the request's node bound.

SpecInfer Section 3: SSMs propose token trees (expansion-based, merged across the pool). One
bidirectional stream per request: the verifier sends accepted prefixes, this service answers each
with the next tree, so each step is one round trip and no new RPC. Trees of all requests are
built together, one batched SSM forward per tree level (speculator worker).
"""

from __future__ import annotations

import logging

import grpc

from services.speculator.config import SpeculatorConfig, parse_config
from specinfer.errors import UserError
from specinfer.model_source import resolve
from specinfer.serving.convert import budget_from_proto, sampling_from_proto, shape_from_proto
from specinfer.serving.trees import tree_to_proto
from specinfer.serving.grpc_server import RunningServer, model_service_main, start_model_service
from specinfer.serving.metrics import ModelMetrics
from specinfer.serving.tracing import server_span
from specinfer.engine.scheduling.workers import SpeculatorWorker
from specinfer.engine.drafting.speculator import Speculator
from specinfer.params import TreeShape
from specinfer.limits import MAX_TREE_DEPTH, PAPER_TREE_WIDTH
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from specinfer.engine.runtime.assemble import model_free_members
from specinfer.engine.runtime.dtype_choice import load_ssm
from specinfer.engine.runtime.load import resolve_device

log = logging.getLogger(__name__)
DEFAULT_SHAPE = TreeShape(PAPER_TREE_WIDTH)


class SpeculatorServicer(pb_grpc.SpeculatorServicer):
    def __init__(self, worker: SpeculatorWorker, names: list[str], tracer):
        self.worker = worker
        self.names = names
        self.tracer = tracer
        runners = worker.speculator.runners
        self.vocab_size = runners[0].cfg.vocab_size
        self.max_context = min(r.max_context for r in runners)

    def Info(self, request, context):
        return pb.SpeculatorInfo(ssm_names=self.names, vocab_size=self.vocab_size, max_context=self.max_context)

    def Speculate(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "start":
            raise UserError("the first message of a Speculate stream must be `start`")
        start = first.start
        context_ids = self._tokens(start.context_ids, "start.context_ids")
        if not context_ids:
            raise UserError("start.context_ids is empty")
        if len(context_ids) >= self.max_context:
            raise UserError(f"start.context_ids: {len(context_ids)} tokens; the SSMs' context holds "
                            f"{self.max_context - 1} before a tree")
        params = sampling_from_proto(start.sampling)
        shape = shape_from_proto(start.shape)
        shape = DEFAULT_SHAPE if shape.is_default else shape
        ssm_indices = self._pool(list(start.ssm_names))
        with server_span(self.tracer, "speculator.speculate", context, request_id=start.request_id,
                         ssm_names=",".join(self.names[i] for i in ssm_indices)) as span:
            session = self.worker.open(context_ids, params, shape, ssm_indices)
            try:
                step = 0
                feedback, max_depth, shape_override = None, int(start.max_depth), None
                is_model_free_only = start.model_free_only  # the model-free members' drafts alone
                budget = budget_from_proto(start.budget) if start.HasField("budget") else None
                num_tokens = len(context_ids)  # verified tokens so far: a tree may not outgrow the context
                while True:
                    depth = max(0, min(max_depth, MAX_TREE_DEPTH, self.max_context - num_tokens - 1))
                    with self.tracer.start_as_current_span("speculator.build_tree") as step_span:
                        tree, seconds, num_levels = self.worker.step(session, feedback, depth, shape_override,
                                                                     is_model_free_only=is_model_free_only,
                                                                     budget=budget)
                        step_span.set_attribute("tree_nodes", len(tree))
                        step_span.set_attribute("tree_depth", tree.max_depth)
                        step_span.set_attribute("step", step)
                        step_span.set_attribute("model_free_only", is_model_free_only)
                        step_span.set_attribute("ssm_levels", num_levels)
                        step_span.set_attribute("batch_size", session.last_batch_size)
                        step_span.set_attribute("drafted_ahead", session.is_last_ahead)
                    yield pb.SpeculateResponse(tree=tree_to_proto(tree), step=step,
                                               speculate_s=seconds, ssm_levels=num_levels)
                    step += 1
                    try:
                        msg = next(request_iterator, None)
                    except grpc.RpcError:  # the verifier went away (cancelled or finished)
                        break
                    if msg is None or msg.WhichOneof("kind") != "feedback" or msg.feedback.done:
                        break
                    fb = msg.feedback
                    feedback = (self._tokens(fb.accepted, "feedback.accepted"), self._tokens([fb.bonus], "feedback.bonus")[0])
                    num_tokens += len(feedback[0]) + 1
                    max_depth = int(fb.max_depth)
                    shape_override = shape_from_proto(fb.shape) if fb.HasField("shape") and fb.shape.widths else None
                    is_model_free_only = fb.model_free_only
                    budget = budget_from_proto(fb.budget) if fb.HasField("budget") else None
                span.set_attribute("steps", step)
            finally:
                self.worker.close(session)

    def _tokens(self, ids, field: str) -> list[int]:
        ids = list(ids)
        if ids and max(ids) >= self.vocab_size:
            raise UserError(f"{field}: token id outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _pool(self, names: list[str]) -> list[int]:
        """The hosted SSMs of the requested pool (other speculators may host the rest)."""
        if not names:
            return list(range(len(self.names)))
        pool = [i for i, name in enumerate(self.names) if name in names]
        if not pool:
            raise UserError(f"start.ssm_names: none of {', '.join(names)} is hosted here ({', '.join(self.names)})")
        return pool


def build(cfg: SpeculatorConfig, exporter=None, is_worker_threaded: bool = True
          ) -> tuple[RunningServer, SpeculatorServicer]:
    """Loads the SSMs and starts serving (used by `main` and by tests). Without a worker thread,
    the caller runs `server.run_worker()` on this thread."""
    device = resolve_device(cfg.device)
    for ssm in cfg.ssm_dirs:  # a GGUF's metadata files under this service's cache directory
        resolve(ssm, cfg.cache_dir)
    runners = [load_ssm(d, cfg.dtype, device, cfg.max_kv_tokens, cfg.execution, cache_dir=cfg.cache_dir)
               for d in cfg.ssm_dirs]
    if len({r.cfg.vocab_size for r in runners}) != 1:
        raise UserError("all SSMs of one speculator must share a vocabulary")
    names = [d.name for d in cfg.ssm_dirs] + list(cfg.model_free)
    # Drafting ahead overlaps the verifier's pass only where the SSMs do not share its CPU cores.
    is_pipelined = cfg.is_pipelined if cfg.is_pipelined is not None else str(device).startswith("cuda")
    model_free = model_free_members(cfg.model_free, cfg.ssm_dirs, cfg.suffix_cache_tokens)

    def create(tracer, registry):
        worker = SpeculatorWorker(Speculator(runners, model_free), max_batch=cfg.max_batch,
                                  metrics=ModelMetrics.create(registry, "speculator"), is_threaded=is_worker_threaded,
                                  is_pipelined=is_pipelined)
        return SpeculatorServicer(worker, names, tracer), worker.worker

    return start_model_service("speculator", cfg, exporter, create, pb_grpc.add_SpeculatorServicer_to_server,
                               pb.DESCRIPTOR.services_by_name["Speculator"].full_name)


def main(argv: list[str] | None = None) -> int:
    return model_service_main("speculator", argv, parse_config, build)
