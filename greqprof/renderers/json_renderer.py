"""The profile's own JSON (``RequestProfile.to_dict()``), which
``RequestProfile.load`` / ``python -m greqprof view`` read back.

A whole-process Profiler is saved in the same schema with
``sampled_by = "profiler"`` (it loads back as a process view)."""
import json

from .base import Renderer, to_request_profile


class JsonRenderer(Renderer):
    name = "json"
    extension = "json"
    description = "greqprof profile JSON (load it back with `view`)"

    def render(self, profile):
        return json.dumps(to_request_profile(profile).to_dict(), indent=1)
