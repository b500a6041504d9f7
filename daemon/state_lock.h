/* ds41_state_lock: one ds41d per state directory.
 *
 * Two daemons on one state_directory would share the embedded model's
 * generation, the snapshot directories and their clean-up (a starting daemon
 * removes the temporary files of unfinished snapshot writes, which would be
 * the other daemon's writes in progress).  So ds41d takes an exclusive
 * flock(2) on <state_directory>/ds41d.lock before it touches anything in the
 * directory and holds it for its whole life (a SIGHUP reload keeps it; the
 * kernel drops it when the process exits, however it exits, so a crash
 * leaves no stale lock).  The holder writes its pid into the file (a line of
 * decimal digits) so a second daemon can name it.  The file is never removed:
 * removing a lock file races with a process that just opened it. */
#ifndef DS41_DAEMON_STATE_LOCK_H
#define DS41_DAEMON_STATE_LOCK_H

#include "config/error.h"

/* The lock file's name inside the state directory. */
#define DS41_STATE_LOCK_FILE "ds41d.lock"

/* Create the state directory when missing (and missing parents, mode 0750
 * before the umask), open its lock file (created 0644, never following a
 * symlink), take the lock without waiting and write this process's pid into
 * it.  Returns the lock's descriptor (close-on-exec; keep it open for the
 * process's life) or -1 with err filled: when another process holds the lock
 * the message is "state directory DIR is in use by ds41d pid N (lock
 * DIR/ds41d.lock)" (the pid as that file says; "an unknown pid" when it holds
 * none). */
int ds41_state_lock_acquire(const char *dir, ds41_error *err);

/* Release the lock (close the descriptor); -1 is ignored. */
void ds41_state_lock_release(int fd);

#endif
