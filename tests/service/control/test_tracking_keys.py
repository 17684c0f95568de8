"""The notes :class:`service.control.tracking.Tracking` hands a tracker: one per event, even when a
failure, RESTARTING and STARTING fall in one millisecond (a real MLflow run lost its RESTARTING
tag that way), with the same keys when a new runner replays the job's history."""

from service.control.events import JobEvent, JobState
from service.control.tracking import Tracking


class _Notes:
    """A tracker run that keeps what it is given (the delivery protocol of tracker_runs)."""

    name, where = "notes", "notes"

    def __init__(self):
        self.notes: dict[str, str] = {}
        self.ended = None

    def open(self):
        return None

    def metrics(self, step, values):
        pass

    def note(self, key, text):
        self.notes[key] = text

    def end(self, state):
        self.ended = state


def _events():
    t = 1796624931.879
    return [JobEvent(time=t, kind="failure", state=JobState.RUNNING, message="rank 1 died", data={}),
            JobEvent(time=t, kind="state", state=JobState.RESTARTING, message="restart 1 after: rank 1 died", data={}),
            JobEvent(time=t, kind="state", state=JobState.STARTING, message="placing ranks (attempt 2)", data={}),
            JobEvent(time=t + 0.5, kind="state", state=JobState.RUNNING, message="training", data={})]


def _delivered(replay: bool) -> dict[str, str]:
    run = _Notes()
    tracking = Tracking(lambda e: None, [run])
    for e in _events():
        (tracking.deliver if replay else tracking)(e)
    tracking.close("SUCCEEDED", grace_s=5)
    assert run.ended == "SUCCEEDED"
    return run.notes


def test_events_in_one_millisecond_keep_a_note_each():
    notes = _delivered(replay=False)
    assert sorted(notes) == ["raytron.event.1796624931879.failure", "raytron.event.1796624931880.state",
                             "raytron.event.1796624931881.state", "raytron.event.1796624932379.state"]
    assert any("restart 1 after" in v for v in notes.values())
    assert _delivered(replay=True) == notes
