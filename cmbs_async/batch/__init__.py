"""Many scenarios at once: plan a batch, run it locally or on Ray, resume it, summarize it."""

from .jobs import BatchError, Job, expand_scenarios, plan
from .progress import Progress
from .results import ResultLog, error_record, result_record
from .runner import BatchReport, run_batch, tune_gc_for_batches
from .summary import render_summary, summarize

__all__ = [
    "BatchError",
    "BatchReport",
    "Job",
    "Progress",
    "ResultLog",
    "error_record",
    "expand_scenarios",
    "plan",
    "render_summary",
    "result_record",
    "run_batch",
    "summarize",
    "tune_gc_for_batches",
]
