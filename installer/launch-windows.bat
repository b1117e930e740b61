@echo off
rem DS-V4.1 Chat launcher for Windows: double-click it (or the Start-menu entry that
rem "py installer\bootstrap.py install-shortcut" makes) to start the app.
rem
rem The first start sets the app up: a window lists each step and its progress (Tk), or this
rem console shows it where Tk is missing. Later starts open the app straight away. The repository
rem is found from this file's own location (%~dp0), so it works from any folder.
rem
rem Environment: DSV41_PYTHON  the python.exe (3.10+) to run the installer with
rem              DSV41_HOME    data folder (default %LOCALAPPDATA%\ds-v41-chat)
setlocal EnableExtensions
title DS-V4.1 Chat
set "BOOT=%~dp0bootstrap.py"
set "CHECK=import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)"

if not exist "%BOOT%" (
    echo The installer is missing: %BOOT%
    echo Keep this launcher inside the DS-V4.1 Chat folder ^(installer\^).
    pause
    exit /b 1
)
cd /d "%~dp0.."

if not defined DSV41_PYTHON goto try_py
"%DSV41_PYTHON%" -c "%CHECK%" >nul 2>nul
if not errorlevel 1 goto use_custom

:try_py
rem The Python launcher (py.exe) picks the newest installed Python 3.
py -3 -c "%CHECK%" >nul 2>nul
if not errorlevel 1 goto use_py
python -c "%CHECK%" >nul 2>nul
if not errorlevel 1 goto use_python

echo.
echo DS-V4.1 Chat needs Python 3.10 or newer, and none was found.
echo Install it from https://www.python.org/downloads/ (tick "Add python.exe to PATH";
echo keep "tcl/tk" ticked for the setup window), then double-click this file again.
echo.
pause
exit /b 1

:use_custom
"%DSV41_PYTHON%" "%BOOT%" run %*
goto done

:use_py
py -3 "%BOOT%" run %*
goto done

:use_python
python "%BOOT%" run %*

:done
set "RC=%ERRORLEVEL%"
if "%RC%"=="0" exit /b 0
echo.
echo DS-V4.1 Chat stopped (exit code %RC%). The messages above say why and what to do.
pause
exit /b %RC%
