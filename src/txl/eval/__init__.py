"""Evaluation: scoring with memory, dynamic evaluation, RECL, sequence-to-sequence metrics."""
