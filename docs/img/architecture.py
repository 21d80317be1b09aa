"""Draw docs/img/request-walk.png: one inference request through sixfold, step by step.

Each step names its layer, its file and its main class or function (docs/architecture.md,
"The walk of one request"). Run it again after moving a step:

    .venv/bin/python docs/img/architecture.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent / "request-walk.png"

LAYER_COLOURS = {
    "client": "#9e9e9e",
    "server/transport": "#4f81bd",
    "server/protocol": "#2a9d8f",
    "server/core.py": "#7b5ea7",
    "server/model": "#e07b39",
    "server/scheduling": "#5a9e48",
    "server/execution": "#c0504d",
    "backends": "#8c6d3f",
}

# (layer, step, code lines, what it does / the tensors after it)
STEPS = [
    ("client", "1  Client sends ModelInfer",
     ["tritonclient, perf_analyzer, sixfold-loadgen",
      "gRPC :8001  or  POST /v2/models/{name}/infer  (REST :8000)"],
     "one request of n items:\ndense_features FP32 [n, D]\nsparse_lengths INT32 [n, T]\nsparse_indices INT64|INT32 [sum(lengths)]"),
    ("server/transport", "2  Transport: protobuf or JSON in",
     ["transport/grpc_servicer.py   InferenceServicer.ModelInfer -> _answer",
      "transport/http_app.py        _Routes.infer  (REST)"],
     "thin: convert, call the core, convert back;\nerrors -> status codes in one decorator"),
    ("server/protocol", "3  Decode the tensors",
     ["protocol/infer_request.py    parse_model_infer  (gRPC wire, no copy)",
      "protocol/codec.py            decode_inputs   (http_codec.decode_request)"],
     "raw tensors: numpy views of the message\nbytes (or of a shared-memory region:\nprotocol/shared_memory.py)"),
    ("server/core.py", "4  Find the model version",
     ["core.py                      InferenceCore.serving(name, version)"],
     "-> ServedModel;  NOT_FOUND, or\nUNAVAILABLE while shutting down"),
    ("server/model", "5  Validate against the signature",
     ["model/served.py              ServedModel.infer",
      "model/validation.py          validate_request"],
     "names, dtypes, shapes, lengths vs ids,\nids vs tables, NaN -> INVALID_ARGUMENT"),
    ("server/scheduling", "6  Admission",
     ["scheduling/batcher.py        DynamicBatcher.enqueue",
      "scheduling/admission.py      PlanCost  (the request's work)"],
     "bounded by count, work and bytes ->\nRESOURCE_EXHAUSTED; a future to await"),
    ("server/scheduling", "7  Dynamic batcher",
     ["scheduling/batcher.py        DynamicBatcher._next_batch -> _execute",
      "np.concatenate on dim 0  ->  ServedModel.run_batch"],
     "one batch of N = sum(n) items\n(max_batch_rows, queue delay, priorities)"),
    ("server/execution", "8  Host stage (sparse): embedding bags",
     ["execution/runtime.py         PlanRuntime.run -> StageRunner.infer",
      "e.g. backends/host/host_embedding.py  HostEmbeddingExecutable"],
     "host_embedding_bag FP32 [N*T, E] on the host\nCPU: the executable's worker thread, or\ninline on the event loop when it is tiny"),
    ("server/scheduling", "9  Card gate",
     ["scheduling/card_gate.py      CardGate.acquire",
      "called by execution/runtime.py  PlanRuntime._dense_on_cards"],
     "cards go to batches in arrival order;\na batch splits over the cards it gets"),
    ("server/scheduling", "10 Router",
     ["scheduling/router.py         LeastLoadedRouter.acquire",
      "called by execution/runtime.py  PlanRuntime._card_stage"],
     "the card with the fewest outstanding rows\n(ties: least recently used)"),
    ("backends", "11 Dense stage on a card",
     ["Executable.infer of the card backend (backends/api.py)",
      "e.g. backends/builtin/simcard.py  SimCardExecutable"],
     "scores FP32 [N, 1]; hang deadline, hedge,\nretry, host fallback: execution/card_health.py"),
    ("server/execution", "12 Split back",
     ["execution/runtime.py         PlanRuntime._split_across_cards",
      "scheduling/batcher.py        DynamicBatcher._execute"],
     "the cards' parts rejoin in order; request i\ngets rows [start_i, start_i + n_i) of the\nbatch's scores (its future is set)"),
    ("server/transport", "13 Response",
     ["model/served.py              ServedModel.infer  (stats, metrics)",
      "protocol/codec.py            encode_response  (http_codec for REST)",
      "transport/grpc_servicer.py   -> ModelInferResponse"],
     "scores FP32 [n, 1] to the client;\nevery request gets an answer or an error"),
]


def main() -> Path:
    gap = 0.38
    heights = [0.5 + 0.27 * len(code) for _, _, code, _ in STEPS]
    height = sum(heights) + gap * len(STEPS) + 1.3
    fig, ax = plt.subplots(figsize=(15, height * 0.82))
    ax.set_xlim(0, 15)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.text(0.1, height - 0.35, "sixfold: the walk of one request", fontsize=19, weight="bold", va="center")
    ax.text(0.1, height - 0.85, "files under server/ are named from server/ (sixfold.server); "
            "backends/ paths from the repository root", fontsize=11, color="#555555", va="center")

    tag_x, tag_w = 0.1, 2.0
    box_x, box_w = 2.3, 7.9
    note_x = 10.4
    y = height - 1.4
    centres = []
    for (layer, title, code, note), step_h in zip(STEPS, heights):
        top, bottom = y, y - step_h
        colour = LAYER_COLOURS[layer]
        ax.add_patch(FancyBboxPatch((tag_x, bottom + 0.08), tag_w, step_h - 0.16,
                                    boxstyle="round,pad=0.02,rounding_size=0.08", fc=colour, ec="none"))
        ax.text(tag_x + tag_w / 2, bottom + step_h / 2, layer, ha="center", va="center", fontsize=11,
                color="white", weight="bold")
        ax.add_patch(FancyBboxPatch((box_x, bottom), box_w, step_h,
                                    boxstyle="round,pad=0.02,rounding_size=0.1", fc="#fbfbfb", ec=colour, lw=2))
        ax.text(box_x + 0.15, top - 0.2, title, fontsize=12.5, weight="bold", va="center")
        for k, line in enumerate(code):
            ax.text(box_x + 0.15, top - 0.5 - 0.27 * k, line, fontsize=10, family="monospace", va="center")
        ax.text(note_x, bottom + step_h / 2, note, fontsize=10.5, color="#333333", va="center", style="italic",
                linespacing=1.25)
        centres.append((top, bottom))
        y = bottom - gap

    for (_, bottom), (top, _) in zip(centres[:-1], centres[1:]):
        ax.add_patch(FancyArrowPatch((box_x + box_w / 2, bottom), (box_x + box_w / 2, top),
                                     arrowstyle="-|>", mutation_scale=16, lw=1.6, color="#444444"))

    fig.savefig(OUT, dpi=110, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return OUT


if __name__ == "__main__":
    print(main())
