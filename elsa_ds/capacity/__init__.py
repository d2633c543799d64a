"""What a machine can hold and how fast it runs a job, decided before the job starts: a model's shapes read from its
config alone (``shapes``), the bytes each rank and node keeps (``resident``, ``memory``), the seconds a step takes
(``step_time``), the host's ops (``machine``), the pre-flight refusals (``preflight``), and the offload ablation that
measures all of it side by side (``ablation``)."""
