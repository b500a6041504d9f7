/* ds41d's log: one line per event on stderr, with a level.  Under systemd (JOURNAL_STREAM set:
 * stderr is the journal) each line starts with the syslog priority prefix "<N>" so journalctl
 * shows the level; on a terminal the level is written as a word ("warning: ...").  Thread-safe
 * (one write(2) per line). */
#ifndef DS41_DAEMON_LOG_H
#define DS41_DAEMON_LOG_H

#include "config/daemon_config.h"

/* Lines above this level are dropped (DS41_LOG_INFO at start). */
void ds41_log_set_level(ds41_log_level level);
ds41_log_level ds41_log_get_level(void);

void ds41_log(ds41_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
