"""Not a package: the repository's root folder. This file exists for one case, a clone named `mmrl/` whose parent
folder is on Python's path (a script saved beside the clone, or `python` started there). Without it, Python takes the
clone's folder for a namespace package `mmrl` ahead of the installed one, and the clone's `runs/` output folder for
`mmrl.runs`: `ImportError: cannot import name 'train' from 'mmrl.runs' (unknown location)`. With it, the import
stops at once and says why."""

import os

if __name__ == "mmrl":
    _clone = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        f"`import {__name__}` found {_clone}, the mmrl repository's clone, not the package inside it: Python looks in "
        f"the script's folder (or the working directory) first, and that is the clone's parent "
        f"{os.path.dirname(_clone)}. Save and run the script in another folder (or inside the clone), or rename the "
        f"clone (e.g. mmrl-repo); the package is {os.path.join(_clone, 'mmrl')} (pip install -e {_clone})")
