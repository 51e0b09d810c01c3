"""The plain-text report (``report.render_text``).

A file or ``view --format text`` keeps every span and greenlet (the log
report shows the 10 longest spans: ``report.DEFAULT_SPANS``)."""
from ..report import render_text
from .base import Renderer, to_request_profile


class TextRenderer(Renderer):
    name = "text"
    extension = "txt"
    description = "plain-text report"

    def __init__(self, max_spans=None, calls_limit=25, greenlets=None):
        self.max_spans = max_spans
        self.calls_limit = calls_limit
        self.greenlets = greenlets

    def render(self, profile):
        return render_text(to_request_profile(profile),
                           spans=self.max_spans,
                           calls_limit=self.calls_limit,
                           greenlets=self.greenlets) + "\n"
