"""Taps: named tensors recorded from a forward pass (registry, recorder, archive, tap-diff).

``taps.Recorder`` / ``taps.Archive`` are imported lazily so that ``import taps`` stays cheap for
producers that only need ``taps.recorder.current()``.
"""


def __getattr__(name):
    if name in ("Recorder", "TapError", "TapCapError"):
        from taps import recorder
        return getattr(recorder, name)
    if name in ("Archive", "MemoryArchive", "ArchiveError"):
        from taps import archive
        return getattr(archive, name)
    raise AttributeError(name)
