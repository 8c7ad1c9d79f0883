"""`loadwise evaluate`: closed-loop throughput of no speculation, every fixed k, the docs' table
and the measured table at several loads, in three parts: ``measure`` writes a raw record as it
runs, ``analyze`` computes every result from a record (pure, re-runnable offline with
``--rescore``), ``render`` prints and plots."""

from loadwise.evaluate.analyze import analyze
from loadwise.evaluate.config import DOCS_TABLE, EvalConfig, configurations
from loadwise.evaluate.legacy import load_record
from loadwise.evaluate.record import EvalRecord, RecordError, RecordHeader, RecordWriter

__all__ = ["DOCS_TABLE", "EvalConfig", "EvalRecord", "RecordError", "RecordHeader",
           "RecordWriter", "analyze", "configurations", "load_record"]
