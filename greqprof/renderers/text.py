"""The plain-text report (``report.render_text``)."""
from ..report import render_text
from .base import Renderer, to_request_profile


class TextRenderer(Renderer):
    name = "text"
    extension = "txt"
    description = "plain-text report"

    def __init__(self, max_spans=100, calls_limit=25):
        self.max_spans = max_spans
        self.calls_limit = calls_limit

    def render(self, profile):
        return render_text(to_request_profile(profile),
                           max_spans=self.max_spans,
                           calls_limit=self.calls_limit) + "\n"
