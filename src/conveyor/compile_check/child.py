"""`python -m conveyor.compile_check.child REQUEST`: one case, one target, one JSON line."""

import json
import sys

from conveyor.compile_check.cases import Case
from conveyor.compile_check.device import compile_case
from conveyor.compile_check.targets import target

if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    case = Case(kind=request["kind"], params=tuple(map(tuple, request["params"])))
    report = compile_case(case, target(request["target"]), request["dump"])
    print(json.dumps(report), flush=True)
