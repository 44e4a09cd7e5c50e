"""Many scenarios at once: plan a batch, run it locally or on Ray, resume it, summarize it."""

from .jobs import BatchError, Job, expand_scenarios, keyword_filter, plan, select
from .progress import Progress
from .results import ERROR_OUTCOMES, ResultLog, error_record, is_error, judged, result_record
from .runner import BatchReport, run_batch, tune_gc_for_batches
from .summary import by_agent, failures, render_evaluation, render_summary, summarize

__all__ = [
    "ERROR_OUTCOMES",
    "BatchError",
    "BatchReport",
    "Job",
    "Progress",
    "ResultLog",
    "by_agent",
    "error_record",
    "expand_scenarios",
    "failures",
    "is_error",
    "judged",
    "keyword_filter",
    "plan",
    "render_evaluation",
    "render_summary",
    "result_record",
    "run_batch",
    "select",
    "summarize",
    "tune_gc_for_batches",
]
