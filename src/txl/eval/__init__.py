"""Evaluation, one module per job (import the one you need; this package imports nothing):

- `result`: EvalResult, metric_value (bpc / ppl), attention_length: a leaf training and serving use
- `precision`: fp32 / bf16 / fp16 / auto autocast (shared with training and the benchmarks)
- `segments`: `evaluate`, a split read as streams of segments with memory; `forward_segment`, the sweep
- `vanilla`: the no-memory baseline (`evaluate_vanilla`) and `context_nll`, one fresh window per token
- `mlm`: masked-LM evaluation of a bidirectional encoder
- `dynamic`: dynamic evaluation (an SGD step after scoring each segment)
- `corpus`: what `txl eval` scores (a checkpoint's split or a text file) and its metric
- `report`: the table `txl eval` prints, per-token files, the memory sweep's markdown and plot
- `api`: `evaluate_checkpoint`, the Python face of `txl eval`
- `recl`: relative effective context length; `seq2seq`, `seq2seq_metrics`: encoder-decoder scores
"""
