"""Files: the one link-safe writer and the one bounded reader (txl.io.files). Knows no model."""

from txl.io.files import (
    CONFIG_LIMIT,
    METRICS_LIMIT,
    STATE_LIMIT,
    VOCAB_LIMIT,
    atomic_file,
    check_own_file,
    create_log,
    fsync_dir,
    is_link,
    open_append,
    open_regular,
    open_update,
    read_bytes,
    read_json,
    read_proc,
    read_text,
    refuse_link,
    remove_stale_temporaries,
    save_array,
    save_figure,
    size_text,
    write_bytes,
    write_figure,
    write_json,
    write_text,
)

__all__ = [
    "CONFIG_LIMIT", "METRICS_LIMIT", "STATE_LIMIT", "VOCAB_LIMIT", "atomic_file", "check_own_file", "create_log", "fsync_dir",
    "is_link", "open_append", "open_regular", "open_update", "read_bytes", "read_json", "read_proc", "read_text", "refuse_link",
    "remove_stale_temporaries", "save_array", "save_figure", "size_text", "write_bytes", "write_json", "write_text",
    "write_figure",
]
