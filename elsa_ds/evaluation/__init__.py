"""The evaluation's measures, a leaf: perplexity over windows (``perplexity``), per-layer sparsity read from the
exported files (``sparsity``), zero-shot accuracy through lm-eval (``zeroshot``) and the results table (``tables``).
They take a model or a folder and return numbers; the runner that loads a model and reports them is the jobs'
``elsa_ds/jobs/evaluate.py``."""
