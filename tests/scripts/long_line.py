"""Write 200 KiB without a newline, then a progress bar redrawn with carriage returns."""

import sys

sys.stdout.write("x" * (200 * 1024))
sys.stdout.write("\n")
for i in range(1000):
    sys.stdout.write(f"\rprogress {i}")
sys.stdout.write("\ndone\n")
sys.stdout.flush()
