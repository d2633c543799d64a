"""The files a job reads and writes, and how they are kept whole: versions and atomic writes (``io``), a model folder's
weight files (``weight_files``), the mask file, the safetensors writer, a full disk as one line (``disk_room``), one
owner per output (``ownership``), the watchdog that cleans up after a killed rank (and what /proc tells it:
``procfs``), and the output directory's staging and publication (``output``). Formats and file discipline only: no
settings, no engines."""
