"""nbgrader configuration of the kvlab course. Run nbgrader from this folder (the course root):

    python ../tools/course.py --out .           # the instructor sources, from the chapters
    nbgrader generate_assignment 04-prefix-reuse
"""

c = get_config()  # noqa: F821 (nbgrader provides it)
c.CourseDirectory.course_id = "kvlab"
# The student version keeps each exercise's placeholders (``x = ...``) above the cleared
# region, so an unanswered exercise prints a hint and Run All goes on (nbgrader's default stub
# raises NotImplementedError, which would stop Run All at the first exercise).
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
# Seconds per cell when autograding; every chapter cell runs in seconds on a laptop.
c.Execute.timeout = 180
