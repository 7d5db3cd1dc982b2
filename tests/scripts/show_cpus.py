"""Print this rank's LOCAL_RANK and the CPUs it may run on (as dsml run left them)."""

import json
import os

print(json.dumps({"rank": int(os.environ["LOCAL_RANK"]), "cpus": sorted(os.sched_getaffinity(0))}))
