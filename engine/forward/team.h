/* A team of threads that outlives the calls it runs (team.c). */

#ifndef BATCHD_TEAM_H
#define BATCHD_TEAM_H

/* Runs part(context, i, parts) for i in [0, parts) with parts = min(threads, what could be
   started), part 0 on the calling thread; returns parts once every part has returned. */
typedef void (*TeamPart)(void *context, int part, int parts);
int batchd_team_run(TeamPart part, void *context, int threads);

#endif
