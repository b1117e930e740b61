"""The installer: standard library only, so that it runs with a bare system Python before the app's
environment exists. Its entry point is ``python3 installer/bootstrap.py`` (see that file); the
launchers (launch-*) start it.

Run as a file, bootstrap.py loads this folder as a package under a private name; the tests import
it as the package ``installer``. The modules import each other relatively either way.
"""
