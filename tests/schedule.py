"""What the tests read of a plain pipeline's program: its copies and its waits for them, typed
(`conveyor.plans.pipeline_program`)."""

from conveyor.plans.program import Action, Copy, Wait


def thread(plan) -> tuple[Action, ...]:
    """The actions of the pipeline's one thread, in issue order."""
    return plan.program()["thread"]


def fetches(plan) -> list[Copy]:
    return [a for a in thread(plan) if isinstance(a, Copy) and a.queue == "loads"]


def stores(plan) -> list[Copy]:
    return [a for a in thread(plan) if isinstance(a, Copy) and a.queue == "stores"]


def fetch_waits(plan) -> list[Wait]:
    return [a for a in thread(plan) if isinstance(a, Wait) and a.counter[0] == "landed"]


def store_waits(plan) -> list[Wait]:
    return [a for a in thread(plan) if isinstance(a, Wait) and a.counter[0] == "stored"]


def issued(plan) -> list[Copy | Wait]:
    """The copies and waits, as a lowering reports them (`record_issued`)."""
    return [a for a in thread(plan) if isinstance(a, (Copy, Wait))]


def slot(action: Copy | Wait) -> int:
    """The on-chip slot a copy fills or drains, or whose copy a wait waits for."""
    if isinstance(action, Wait):
        return action.counter[2]
    return (action.writes if action.queue == "loads" else action.reads)[0][1]


def waited_step(wait: Wait) -> int:
    """The grid step whose fetched block a fetch wait waits for."""
    return wait.counter[3]
