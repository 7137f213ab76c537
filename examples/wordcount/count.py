"""Count the words of a text: GPUlayer's first example job.

Run it (from the repository root) with:

    gpulayer run examples/wordcount/count.py --input text=examples/wordcount/input.txt --output counts.json

The input arrives under the name given (``text``); ``counts.json`` is kept as
an output and fetched into ``examples/wordcount/gpulayer_runs/<job id>/``.
"""

import collections
import json
import os
import re
import sys

top = int(sys.argv[1]) if len(sys.argv) > 1 else 5
path = os.path.join(os.environ.get("GPULAYER_INPUTS", "."), "text")
with open(path, encoding="utf-8") as f:
    words = re.findall(r"[a-z']+", f.read().lower())
counts = collections.Counter(words)
print(f"read {len(words)} words ({len(counts)} distinct) from {os.path.basename(path)}")
for word, n in counts.most_common(top):
    print(f"{n:5d}  {word}")
with open("counts.json", "w", encoding="utf-8") as f:
    json.dump(dict(counts.most_common()), f, indent=1)
print("wrote counts.json", file=sys.stderr)
