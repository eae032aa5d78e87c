"""Write the HTML report of a finished (or running) work dir: a training run's, or an
evaluation's output directory.

    python -m launch.report runs/quickstart      # -> runs/quickstart/report.html

What the report shows: `ptrain.report`.
"""

from absl import app, flags

flags.DEFINE_string("title", "", "The report's title (default: the directory's name).")


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: python -m launch.report WORKDIR")
    from ptrain import report
    try:
        print(report.write_report(argv[1], title=flags.FLAGS.title))
    except FileNotFoundError as e:
        raise app.UsageError(str(e)) from None


if __name__ == "__main__":
    app.run(main)
