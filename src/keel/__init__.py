"""keel: LLM pre-training built to production standards, from one CPU process to thousands of GPUs."""

import os
import time

__version__ = "0.1.0"
STARTED = time.time()  # when this process first imported keel: recovery times are measured from it
ENVIRON = dict(os.environ)  # as this process found it: a launcher that starts itself again starts as it did
