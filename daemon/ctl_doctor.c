/* ds41ctl doctor: checks this machine for ds41d -- the daemon, io_uring, the checkpoint and
 * O_DIRECT on its directory, memlock, CPU features, the CPU kernel level and threads, GPU, free
 * memory (see ds41ctl(1)). */
#include "config/buf.h"
#include "config/model_config.h"
#include "daemon/ctl_client.h"
#include "daemon/ctl_internal.h"
#include "engine/serve/auto_budget.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/cpu/threadpool.h"
#include "storage/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct doctor {
    table t;
    json_t *arr;
    int fails;
} doctor;

static void dr(doctor *d, const char *check, const char *status, const char *detail) {
    table_row(&d->t, check, status, detail);
    json_array_append_new(d->arr, json_pack("{s:s s:s s:s}", "check", check, "status", status, "detail", detail));
    if (strcmp(status, "fail") == 0) d->fails++;
}

static void doctor_odirect(doctor *d, const char *dir) {
    DIR *dh = opendir(dir);
    if (!dh) {
        dr(d, "O_DIRECT", "fail", fmt("%s: %s", dir, strerror(errno)));
        return;
    }
    char file[4096] = "";
    struct dirent *e;
    while ((e = readdir(dh))) {
        size_t n = strlen(e->d_name);
        if (n > 12 && strcmp(e->d_name + n - 12, ".safetensors") == 0) {
            snprintf(file, sizeof file, "%s/%s", dir, e->d_name);
            break;
        }
    }
    closedir(dh);
    if (!file[0]) {
        dr(d, "O_DIRECT", "warn", fmt("no .safetensors file in %s", dir));
        return;
    }
    int fd = open(file, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
        dr(d, "O_DIRECT", "fail", fmt("open: %s", strerror(errno)));
        return;
    }
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, 4096) != 0) {
        close(fd);
        dr(d, "O_DIRECT", "fail", "out of memory");
        return;
    }
    ssize_t got = pread(fd, buf, 4096, 0);
    int err = errno;
    close(fd);
    free(buf);
    if (got < 0)
        dr(d, "O_DIRECT", "fail", fmt("read: %s", strerror(err)));
    else
        dr(d, "O_DIRECT", "ok", fmt("aligned reads work on %.90s", dir));
}

/* Whether DIR is a checkpoint ds41d can load: inference/config.json valid, every safetensors
 * header readable (headers only: no payload page is touched), tokenizer.json present.  A Hugging
 * Face directory with only its root config.json fails here, naming what is missing. */
static void doctor_checkpoint(doctor *d, const char *dir) {
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        dr(d, "checkpoint", "fail",
           fmt("%.90s: %s", dir, stat(dir, &st) != 0 ? strerror(errno) : "not a directory"));
        return;
    }
    ds41_model_config cfg;
    ds41_error err = {{0}};
    if (ds41_model_config_load(dir, &cfg, &err) != 0) {
        char root[4096];
        snprintf(root, sizeof root, "%s/config.json", dir);
        dr(d, "checkpoint", "fail",
           fmt("not a ds41 checkpoint: %.70s%s", err.msg,
               access(root, F_OK) == 0
                   ? " (a root config.json alone is not enough: inference/config.json is read)"
                   : ""));
        return;
    }
    ds41_model_config_free(&cfg);
    ds41_checkpoint *ck = ds41_checkpoint_open(dir, &err);
    if (!ck) {
        dr(d, "checkpoint", "fail", fmt("not a ds41 checkpoint: %.100s", err.msg));
        return;
    }
    char tokp[4096];
    snprintf(tokp, sizeof tokp, "%s/tokenizer.json", dir);
    char b[32];
    human_bytes((double)ds41_checkpoint_payload_bytes(ck), b, sizeof b);
    if (access(tokp, R_OK) != 0)
        dr(d, "checkpoint", "fail", fmt("%.60s: no readable tokenizer.json", dir));
    else
        dr(d, "checkpoint", "ok",
           fmt("%zu tensors, %s of weights; inference/config.json and tokenizer.json present",
               ds41_checkpoint_tensor_count(ck), b));
    ds41_checkpoint_close(ck);
}

int cmd_doctor(int argc, char **argv) {
    static const struct option lo[] = {{"model", required_argument, NULL, 'm'}, {NULL, 0, NULL, 0}};
    const char *model_dir = NULL;
    optind = 0; /* 0, not 1: glibc then re-initialises, dropping the "+" (stop at the first non-option) mode of the top-level parse */
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c == 'm')
            model_dir = optarg;
        else
            return 2;
    }
    doctor d = {.t = {.cols = 3}, .arr = json_array()};
    table_row(&d.t, "CHECK", "STATUS", "DETAIL");

    /* the daemon */
    ds41_ctl_response r;
    ds41_error err = {{0}};
    char *daemon_model = NULL;
    char daemon_threads[160] = "";
    if (ds41_ctl_request(g_socket, "GET", "/health", NULL, 0, 5000, &r, &err) == 0) {
        dr(&d, "daemon", r.status == 200 ? "ok" : "warn", fmt("%s answers %d %.60s", g_socket, r.status, r.body));
        ds41_ctl_response_free(&r);
        json_t *m = call_json("GET", "/admin/models", NULL, NULL, true);
        if (m) {
            json_t *first = json_array_get(json_object_get(m, "data"), 0);
            if (first && jstr(first, "path")[0]) daemon_model = strdup(jstr(first, "path"));
            /* the threads of the daemon's loaded engines, as it reports them */
            size_t i;
            json_t *e;
            json_array_foreach(json_object_get(m, "data"), i, e) {
                if (jint(e, "threads") <= 0) continue;
                size_t used = strlen(daemon_threads);
                snprintf(daemon_threads + used, sizeof daemon_threads - used, "%s%.40s %lld",
                         used ? ", " : "", jstr(e, "id"), jint(e, "threads"));
            }
            json_decref(m);
        }
        /* The memory budgets the daemon decided at load (admin only; quiet otherwise). */
        json_t *cj = call_json("GET", "/admin/cache", NULL, NULL, true);
        if (cj && jstr(cj, "budgets")[0]) dr(&d, "budgets", "ok", jstr(cj, "budgets"));
        json_decref(cj);
    } else {
        dr(&d, "daemon", "warn", err.msg);
    }

    /* io_uring */
#ifdef SYS_io_uring_setup
    {
        unsigned char params[120] = {0}; /* struct io_uring_params */
        long fd = syscall(SYS_io_uring_setup, 4, params);
        if (fd >= 0) {
            close((int)fd);
            dr(&d, "io_uring", "ok", "io_uring_setup works");
        } else {
            int e = errno;
            dr(&d, "io_uring", "fail",
               fmt("io_uring_setup: %s%s", strerror(e),
                   e == EPERM ? " (kernel.io_uring_disabled or a seccomp filter)" : e == ENOSYS ? " (kernel too old)" : ""));
        }
    }
#else
    dr(&d, "io_uring", "fail", "not available on this platform");
#endif

    /* O_DIRECT on the model directory */
    const char *dir = model_dir ? model_dir : daemon_model;
    if (dir) doctor_checkpoint(&d, dir);
    if (dir)
        doctor_odirect(&d, dir);
    else
        dr(&d, "O_DIRECT", "warn", "no model directory (give --model DIR, or run as an admin)");
    free(daemon_model);

    /* memlock */
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
        if (rl.rlim_cur == RLIM_INFINITY)
            dr(&d, "memlock", "ok", "unlimited");
        else {
            char b[32];
            human_bytes((double)rl.rlim_cur, b, sizeof b);
            dr(&d, "memlock", rl.rlim_cur >= (64ull << 20) ? "ok" : "warn",
               fmt("%s locked memory allowed (the service sets LimitMEMLOCK=infinity)", b));
        }
    }

    /* CPU features, from the kernel's view (/proc/cpuinfo "flags" on x86, "Features" on Arm) */
    {
        static const char *const wanted[] = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile",
                                             "asimd", "asimddp", "asimdhp", "sve", "sve2", "i8mm", "bf16", NULL};
        ds41_buf f = {0};
        bool good = false;
        FILE *fc = fopen("/proc/cpuinfo", "r");
        char *line = NULL;
        size_t cap = 0;
        while (fc && getline(&line, &cap, fc) > 0) {
            if (strncmp(line, "flags", 5) != 0 && strncmp(line, "Features", 8) != 0) continue;
            for (size_t k = 0; wanted[k]; k++) {
                size_t wl = strlen(wanted[k]);
                for (const char *p = strchr(line, ':'); p && (p = strstr(p, wanted[k])); p += wl) {
                    if ((p[-1] == ' ' || p[-1] == ':') && (p[wl] == ' ' || p[wl] == '\n' || p[wl] == 0)) {
                        ds41_buf_printf(&f, "%s ", wanted[k]);
                        break;
                    }
                }
            }
            good = f.data && ((strstr(f.data, "avx2 ") && strstr(f.data, "fma ")) || strstr(f.data, "asimd "));
            break;
        }
        free(line);
        if (fc) fclose(fc);
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        ds41_buf_printf(&f, "(%ld CPUs)", ncpu);
        dr(&d, "cpu", good ? "ok" : "warn", f.data ? f.data : "");
        ds41_buf_free(&f);
    }

    /* the fast CPU path this machine gets (engine/backend/cpu/cpu_backend.h), and its default thread count */
    {
        ds41_cpu_level lv = ds41_cpu_level_detect();
        const char *cap = getenv("DS41_CPU_LEVEL");
        char threads[200];
        if (daemon_threads[0])
            snprintf(threads, sizeof threads, "the daemon's threads: %s", daemon_threads);
        else
            snprintf(threads, sizeof threads,
                     "%d threads by default here (one per usable CPU; the daemon's own count needs admin)",
                     ds41_cpu_count());
        dr(&d, "backend", lv >= DS41_CPU_AVX2 ? "ok" : "warn",
           fmt("fast CPU kernels at level %s%s%s%s; %.120s", ds41_cpu_level_name(lv),
               cap && *cap ? " (DS41_CPU_LEVEL=" : "", cap && *cap ? cap : "", cap && *cap ? ")" : "",
               threads));
    }

    /* GPU */
    {
        FILE *fv = fopen("/proc/driver/nvidia/version", "r");
        if (fv) {
            char line[256] = "";
            if (!fgets(line, sizeof line, fv)) line[0] = 0;
            fclose(fv);
            line[strcspn(line, "\n")] = 0;
            dr(&d, "gpu", "ok", fmt("NVIDIA driver: %.100s", line));
        } else if (access("/dev/nvidia0", F_OK) == 0) {
            dr(&d, "gpu", "ok", "/dev/nvidia0 present");
        } else {
            dr(&d, "gpu", "warn", "no NVIDIA GPU found (CPU only)");
        }
    }

    /* memory */
    {
        FILE *fm = fopen("/proc/meminfo", "r");
        long long total = -1, avail = -1;
        char line[256];
        while (fm && fgets(line, sizeof line, fm)) {
            if (sscanf(line, "MemTotal: %lld kB", &total) == 1) continue;
            sscanf(line, "MemAvailable: %lld kB", &avail);
        }
        if (fm) fclose(fm);
        if (total > 0 && avail >= 0) {
            char a[32], t[32];
            human_bytes((double)avail * 1024, a, sizeof a);
            human_bytes((double)total * 1024, t, sizeof t);
            dr(&d, "memory", avail * 1024 >= (4ll << 30) ? "ok" : "warn", fmt("%s available of %s", a, t));
        } else {
            dr(&d, "memory", "warn", "cannot read /proc/meminfo");
        }
        /* A cgroup v2 limit below MemAvailable is what "auto" budgets size against. */
        ds41_mem_info mi;
        if (ds41_mem_read(NULL, &mi, NULL) == 0 && mi.cgroup_free < mi.mem_available) {
            char a[32];
            human_bytes((double)mi.cgroup_free, a, sizeof a);
            dr(&d, "cgroup", "ok", fmt("%s may be used under the memory.max of %s", a, mi.cgroup_dir));
        }
    }
    if (g_json) {
        print_json(d.arr);
        table_free(&d.t);
    } else {
        table_print(&d.t);
    }
    json_decref(d.arr);
    return d.fails ? 1 : 0;
}
