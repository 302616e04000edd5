"""nncompile's IR: Graph, Op, Value, placements, the printer and the verifier."""
from .graph import (BUFFER, CONST, FREE_KINDS, PARAM, USER_INPUT, Graph, MemoryChoice, Op, ParamPart,
                    PipelinePlan, PlanState,
                    RecomputeMark, SourceInfo, Stage, Strategy, TensorMeta, TraceInfo, Value,
                    flatten, map_nested, target_name)
from .placement import (P, R, Partial, Placement, Replicate, Shard, local_shape, parse_placement,
                        part_slices, shard_slices)
from .placement import StridedShard, join_pieces, piece_of, strided  # noqa: E402
from .printer import DEVICE, PLAN_GROUP, Symbol, fmt_literal, print_graph
from .verify import verify
from .interpret import run_graph

__all__ = ["P", "R", "Graph", "Op", "Value", "TensorMeta", "SourceInfo", "Strategy", "Placement",
           "Replicate", "Shard", "Partial", "print_graph", "verify", "local_shape",
           "shard_slices", "part_slices", "ParamPart", "parse_placement", "flatten", "map_nested", "target_name", "Symbol", "DEVICE",
           "PLAN_GROUP", "fmt_literal", "run_graph", "USER_INPUT", "PARAM", "BUFFER", "CONST",
           "FREE_KINDS", "Stage", "RecomputeMark", "TraceInfo", "PlanState", "MemoryChoice", "PipelinePlan"]
__all__ += ["StridedShard", "strided", "piece_of", "join_pieces"]
from .parse import (IRParseError, assert_graph_equal, graph_diff, graphs_equal,  # noqa: E402
                    parse_graph)
__all__ += ["parse_graph", "graph_diff", "graphs_equal", "assert_graph_equal", "IRParseError"]
