"""nbgrader configuration of the kvlab course. Run nbgrader from this folder (the course root):

    python ../tools/course.py --out .           # the instructor sources, from the chapters
    nbgrader generate_assignment 04-prefix-reuse

The teacher's workflow without JupyterHub (release, fetch, submit, collect, autograde,
feedback on one machine) is in README.md beside this file.
"""

from pathlib import Path

c = get_config()  # noqa: F821 (nbgrader provides it)
c.CourseDirectory.course_id = "kvlab"
# The exchange: where `nbgrader release_assignment` puts the student versions, students'
# `nbgrader submit` puts their work and `release_feedback` the feedback. Without JupyterHub it
# is a folder every account of the machine can write (nbgrader's default is
# /usr/local/share/nbgrader/exchange, which needs root): here `exchange/` beside this file,
# which `make course` creates. On a machine students share, point it at such a folder
# (mkdir, chmod ugo+rwx) and give students the same path (course/README.md).
c.Exchange.root = str(Path(__file__).resolve().parent / "exchange")
# The student version keeps each exercise's placeholders (``x = ...``) above the cleared
# region, so an unanswered exercise prints a hint and Run All goes on (nbgrader's default stub
# raises NotImplementedError, which would stop Run All at the first exercise).
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
# Seconds per cell when autograding; every chapter cell runs in seconds on a laptop.
c.Execute.timeout = 180
