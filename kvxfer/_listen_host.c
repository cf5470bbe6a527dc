/*
 * Binds UCX sockaddr listeners to one address instead of every interface.
 *
 * ucxx's Python binding creates listeners with only a port (libucxx's ListenerBuilder::host()
 * is not exposed), so libucxx asks UCX to listen on INADDR_ANY. This library defines
 * `ucp_listener_create`; loaded with RTLD_GLOBAL before ucxx loads libucxx (RTLD_LOCAL, as
 * the libucx wheel does), it is found first when libucxx.so's references are bound. It
 * replaces a wildcard address with the one set by `pdserve_ucx_listen_host` (same port) and
 * calls the real function in the already loaded libucp. A listener whose address is not the
 * wildcard, or any listener while no host is set, passes through unchanged.
 *
 * kvxfer.listen loads it (ctypes) and checks each listener's bound address afterwards, so a
 * process where the interposition did not take (ucxx imported first) is caught, not trusted.
 *
 * Only the public, stable head of ucp_listener_params_t is used (UCX >= 1.9 layout).
 */
#define _GNU_SOURCE
#include <Python.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef struct {
    const struct sockaddr *addr;
    socklen_t addrlen;
} sock_addr_t; /* ucs_sock_addr_t */

typedef struct {
    void *cb;
    void *arg;
} handler_t; /* ucp_listener_accept_handler_t / ucp_listener_conn_handler_t */

typedef struct {
    uint64_t field_mask;
    sock_addr_t sockaddr;
    handler_t accept_handler;
    handler_t conn_handler;
} listener_params_t; /* ucp_listener_params_t */

#define FIELD_SOCK_ADDR (1ULL << 0) /* UCP_LISTENER_PARAM_FIELD_SOCK_ADDR */
#define STATUS_ERR_NO_MEMORY (-4)  /* UCS_ERR_NO_MEMORY */
#define STATUS_ERR_NO_ELEM (-12)   /* UCS_ERR_NO_ELEM */

typedef int (*create_fn)(void *worker, const listener_params_t *params, void **listener_p);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct sockaddr_storage host_addr; /* ss_family 0 while unset */
static unsigned long rebound;             /* listeners moved off the wildcard */

/* Set the address wildcard listeners bind to ("" clears it). Returns 0, or -1 if `host` is
 * not a numeric IPv4/IPv6 address. */
int pdserve_ucx_listen_host(const char *host)
{
    struct sockaddr_storage parsed;
    memset(&parsed, 0, sizeof(parsed));
    if (host != NULL && host[0] != '\0') {
        struct sockaddr_in *v4 = (struct sockaddr_in *)&parsed;
        struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&parsed;
        if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
            v4->sin_family = AF_INET;
        } else if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
            v6->sin6_family = AF_INET6;
        } else {
            return -1;
        }
    }
    pthread_mutex_lock(&lock);
    host_addr = parsed;
    pthread_mutex_unlock(&lock);
    return 0;
}

/* How many listeners were moved from the wildcard to the set host. */
unsigned long pdserve_ucx_listeners_rebound(void)
{
    pthread_mutex_lock(&lock);
    unsigned long n = rebound;
    pthread_mutex_unlock(&lock);
    return n;
}

static create_fn real_create(void)
{
    static create_fn fn;
    if (fn == NULL) {
        void *ucp = dlopen("libucp.so.0", RTLD_NOW | RTLD_NOLOAD);
        if (ucp != NULL) {
            fn = (create_fn)dlsym(ucp, "ucp_listener_create");
            dlclose(ucp);
        }
        if (fn == NULL) {
            fn = (create_fn)dlsym(RTLD_NEXT, "ucp_listener_create");
        }
    }
    return fn;
}

static int is_wildcard(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET) {
        return ((const struct sockaddr_in *)sa)->sin_addr.s_addr == htonl(INADDR_ANY);
    }
    if (sa->sa_family == AF_INET6) {
        return memcmp(&((const struct sockaddr_in6 *)sa)->sin6_addr, &in6addr_any,
                      sizeof(struct in6_addr)) == 0;
    }
    return 0;
}

static uint16_t port_of(const struct sockaddr *sa)
{
    return sa->sa_family == AF_INET ? ((const struct sockaddr_in *)sa)->sin_port
                                    : ((const struct sockaddr_in6 *)sa)->sin6_port;
}

int ucp_listener_create(void *worker, const listener_params_t *params, void **listener_p)
{
    create_fn create = real_create();
    if (create == NULL) {
        return STATUS_ERR_NO_ELEM;
    }
    if (!(params->field_mask & FIELD_SOCK_ADDR) || params->sockaddr.addr == NULL ||
        !is_wildcard(params->sockaddr.addr)) {
        return create(worker, params, listener_p);
    }
    struct sockaddr_storage host;
    pthread_mutex_lock(&lock);
    host = host_addr;
    pthread_mutex_unlock(&lock);
    if (host.ss_family == 0) {
        return create(worker, params, listener_p);
    }
    /* Kept for the process's life (a listener or two per process): whether UCX keeps the
     * pointer is its business, so it must stay valid. */
    struct sockaddr_storage *bind_to = malloc(sizeof(*bind_to));
    if (bind_to == NULL) {
        return STATUS_ERR_NO_MEMORY;
    }
    *bind_to = host;
    uint16_t port = port_of(params->sockaddr.addr);
    listener_params_t moved = *params;
    if (bind_to->ss_family == AF_INET) {
        ((struct sockaddr_in *)bind_to)->sin_port = port;
        moved.sockaddr.addrlen = sizeof(struct sockaddr_in);
    } else {
        ((struct sockaddr_in6 *)bind_to)->sin6_port = port;
        moved.sockaddr.addrlen = sizeof(struct sockaddr_in6);
    }
    moved.sockaddr.addr = (const struct sockaddr *)bind_to;
    int status = create(worker, &moved, listener_p);
    if (status == 0) {
        pthread_mutex_lock(&lock);
        rebound++;
        pthread_mutex_unlock(&lock);
    }
    return status;
}

/* An importable module too, so that importlib finds the file; the API above is for ctypes. */
static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvxfer._listen_host",
    "UCX listeners on one address; see kvxfer.listen.", -1, NULL,
};

PyMODINIT_FUNC PyInit__listen_host(void)
{
    return PyModule_Create(&module);
}
