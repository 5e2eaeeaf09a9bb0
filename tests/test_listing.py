import pytest

from batchlab.course.listing import source_lines
from batchlab.core.scheduler import ContinuousScheduler


def test_whole_and_sliced_listings():
    whole = source_lines(ContinuousScheduler.batches)
    assert whole.startswith("def batches(self):")  # dedented: reads as a plain function
    part = source_lines(ContinuousScheduler.batches, start="self.admit()", end="self.place()")
    assert part.splitlines() == ["self.admit()", "yield from self.prefill_chunk()"]


def test_a_missing_anchor_is_an_error_naming_it():
    with pytest.raises(
        ValueError, match="'# no such comment' is not in the source of ContinuousScheduler.batches"
    ):
        source_lines(ContinuousScheduler.batches, start="# no such comment")
    with pytest.raises(ValueError, match="'nowhere' is not in the source"):
        source_lines(ContinuousScheduler.batches, start="self.admit()", end="nowhere")
